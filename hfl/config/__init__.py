"""The configuration: Hydra's schema of every key, and the checks run before training."""
