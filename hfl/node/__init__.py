"""The node: a client outside (NodeClient), a strategy inside (NodeStrategy; the root's RootStrategy,
driven one global round at a time by RootServer), the round loop every node runs, who a round asks,
the lockstep, evaluation counts and simulated faults."""
