"""The batched accelerator: every device of a node stepped as one computation (CPU or GPU),
numerically the per-device path's (skip on a first read)."""
