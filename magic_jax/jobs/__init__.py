"""The commands: the CLI, evaluation, difficulty estimation, the TPU planner, the demo and
its build, reports."""
