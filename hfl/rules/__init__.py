"""What a message carries (hfl.rules.payload), and the update steps the algorithms share: weighted
means, node optimisers, mixing and head/body splits."""
