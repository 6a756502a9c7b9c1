"""The update: advantages, losses, the entropy controller, the rollout buffer, the pure
step and its host loop."""
