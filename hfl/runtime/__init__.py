"""Runtimes: building a node's subtree from the config, the Flower apps, hfl-simulate (Ray or in-process)."""
