"""metrics.jsonl: the run's per-step records, a JSON object a line. Rank 0 appends each log
step's as it happens (rank/metrics/log.py); the driver follows the file while the ranks train
(its live W&B run) and reads it whole once they are done (completed or failed).
rolled_back.jsonl: the steps a train.guard rollback trained again, as they were the first
time, each with the rollback's number."""

METRICS_FILE = "metrics.jsonl"
ROLLED_BACK_FILE = "rolled_back.jsonl"
