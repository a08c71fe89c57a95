"""`meshrun-doctor`: versions, devices (CUDA vs nvidia-smi order), backend health checks."""
