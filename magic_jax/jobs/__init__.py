"""The commands: the CLI, the scoring jobs (evaluation, difficulty estimation), the TPU
planner, the default run, the worlds' builds and the decision world's pilots, reports."""
