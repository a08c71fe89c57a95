#!/usr/bin/env bash
# The GPU checks in one go, for a machine with CUDA (run from the repository root), ending in
# one table, a line per check (PASS / FAIL / SKIPPED with why), and the same as JSON:
#   $OUT/gpu-check.txt, $OUT/gpu-check.json, every check's output tail in
#   $OUT/gpu-check-logs.txt ($OUT: outputs/gpu-check unless set).
# The checks (scripts/gpu_checks.py, most telling first) run to one deadline,
# GPU_CHECK_BUDGET_S (570 s; on one GPU the last ones may be SKIPPED out of time), over the GPUs
# torch sees (CUDA_VISIBLE_DEVICES and MIG honoured), side by side where a box has several
# (scripts/gpu_check.py). `scripts/gpu-check.sh --only NAME` runs the checks whose name has
# NAME; `--dry-run` lists what would run.
#
# Uses the python on PATH (PYTHON=...) with the repository's src/ on PYTHONPATH, so a
# machine's own CUDA torch is used as it is, and meshrun need not be installed.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-outputs/gpu-check}
mkdir -p "$OUT"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# On an image without network: meshrun's needs from wheels built ahead
# (scripts/build-gpu-wheels.sh) and carried with the tree, installed offline; the image's own
# torch stays (no torch wheel is there).
wheels=${WHEELS:-outputs/gpu-wheels}
if [ -f "$wheels/requirements.txt" ]; then
  echo "gpu-check: installing meshrun's needs offline from $wheels"
  $py -m pip install -q --no-index --find-links "$wheels" -r "$wheels/requirements.txt" 2>&1 \
    | tail -5 || echo "gpu-check: the offline install from $wheels FAILED (checks may not import)"
fi
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
  || echo "gpu-check: $py has no torch"
exec $py scripts/gpu_check.py "$@"
