"""Simulated time: the clock's figures (hfl.clock.model), how nodes close rounds (hfl.clock.policy)
and a child dead for one round (hfl.clock.dropped)."""
