"""A device: its state, local training and the device client base every algorithm's client extends."""
