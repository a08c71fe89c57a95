#!/usr/bin/env bash
# The GPU checks in one command, for a CUDA box without a package index (run from the
# repository root; docs/development.md, "An offline GPU node", has the whole procedure):
#
#   scripts/gpu-check.sh                 # install the carried wheels, then every check
#   scripts/gpu-check.sh --only NAME     # the checks whose name has NAME (repeatable)
#   scripts/gpu-check.sh --dry-run       # what would run
#   scripts/gpu-check.sh --rehearse      # here, before: the same on an image-like venv
#
# One deadline, counted from this script's start, the install inside it: GPU_CHECK_BUDGET_S
# (540 s, the device tool's 600 less a margin). The wheels of outputs/gpu-wheels
# (scripts/build-gpu-wheels.sh; WHEELS=DIR) install offline first: meshrun's core needs
# alone, checked by import (the script stops at once, exit 3, saying why, where they fail),
# then the extras. The checks (scripts/gpu_checks.py, run by scripts/gpu_check.py) work under
# GPU_CHECK_WORK (/tmp/meshrun-gpu-check); $OUT (outputs/gpu-check) gets gpu-check.txt and
# gpu-check.json, rewritten after every check, gpu-check-logs.txt (the install's and each
# check's output tail) and at most five artefacts: 8 files, what the device tool brings back.
# Exit 0 where nothing FAILed, 1 where something did, 2 where an --only names no check.
#
# Uses the python on PATH (PYTHON=...) with the repository's src/ on PYTHONPATH: the image's
# own CUDA torch is used as it is, and meshrun need not be installed.
set -uo pipefail
cd "$(dirname "$0")/.."
export GPU_CHECK_STARTED=${GPU_CHECK_STARTED:-$(date +%s)}
export OUT=${OUT:-outputs/gpu-check}
py=${PYTHON:-python3}
if [ "${1:-}" = --rehearse ]; then
  shift
  exec "$py" scripts/gpu_rehearsal.py "$@"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
  || echo "gpu-check: $py has no torch"
exec $py scripts/gpu_checks.py "$@"
