"""A training run: its config, the loop, stages, checkpoints, the run directory and its
lock, metrics, the policy it loads."""
