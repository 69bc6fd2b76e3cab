"""Outputs: the run's recorder (metrics.jsonl, checkpoints), the console, plots and reports."""
