"""State that outlives a message: the versioned state store and resuming a killed run."""
