"""Update steps the algorithms share: weighted means, node optimisers, mixing and head/body splits."""
