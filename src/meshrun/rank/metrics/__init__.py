"""What every run measures: step time and throughput, peak memory, FLOPs and MFU."""
