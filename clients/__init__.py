"""Device clients: one Flower NumPyClient per algorithm."""
