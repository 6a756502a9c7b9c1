"""Prompt data: verl / Skywork rows from JSONL, Parquet or tfds, rendering, tokenising,
filtering, step batches; the shipped tasks."""
