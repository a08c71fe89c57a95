"""`meshrun-comm`: collectives timed like nccl-tests, over the training launchers."""
