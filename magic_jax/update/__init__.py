"""The update: advantages, losses, the log-prob and entropy kernels, the entropy
controller, the rollout buffer, the pure step and its host loop."""
