"""The tree: its shape (paths, levels, children), its formation from the topology config, and seeded sampling."""
