"""Simulated time: the clock's figures (hfl.clock.model) and how nodes close rounds (hfl.clock.policy)."""
