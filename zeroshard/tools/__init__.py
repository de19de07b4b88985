"""Tools over a config and a model: `explain` (the resolved plan) and the memory estimate."""
