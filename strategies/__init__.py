"""Team and global Flower strategies: one module per algorithm."""
