"""Diagnostics: `meshrun-comm` (collective benchmark in the manner of nccl-tests) and
`meshrun-doctor` (versions, devices, backend health checks)."""
