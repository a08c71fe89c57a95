"""What every rank measures as it trains: step times, peak memory, the pipeline bubble,
compile time, its CPU against the host's; rank 0's metrics.jsonl."""
