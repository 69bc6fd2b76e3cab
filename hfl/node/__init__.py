"""The node: a client outside (NodeClient), a strategy inside (NodeStrategy; the root's RootStrategy),
the in-process round loop and lockstep, evaluation counts and simulated faults."""
