"""Where results go: the run directory, the SQLite store, W&B, the console."""
