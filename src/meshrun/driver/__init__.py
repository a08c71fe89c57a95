"""What runs once per experiment: compose (Hydra), resolve, launch the ranks, record the
results (results.json, store, W&B, console)."""
