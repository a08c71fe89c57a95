#!/usr/bin/env bash
# The fast subset on the oldest torch meshrun is tested on (the floor): every layout's parity
# with one device, a checkpoint resume (FSDP2, sharded DCP) and the CLI (the quick start,
# DDP with its measured baseline), in a venv of its own beside make install's .venv.
#
#   scripts/test-torch-floor.sh install   # the venv: torch $floor and meshrun[dev,hf]
#   scripts/test-torch-floor.sh test      # the subset in it
#   scripts/test-torch-floor.sh           # both
#
# PyPI's Linux torch below the CPU wheel make install uses is a CUDA build: it imports and
# runs on the CPU, but only with its nvidia-* packages (libcudnn, libcublas, ... are linked
# in): ~2.7 GB downloaded by uv on a machine without its cache, ~60 MB/s here. There is no
# +cpu build of 2.11 on PyPI, and PyTorch's own index is not reachable from CI.
# Measured on the 2-core box beside other jobs (load average 6-11), torch 2.11.0: install 160 s
# from a cold uv cache, 78 s with the wheels cached; the subset's 26 tests 145-191 s (the same
# tests on 2.13 in .venv: 139 s at the same load). Not in .ci/run: it would add ~2-3 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
floor=${MESHRUN_TORCH_FLOOR:-2.11.0}
venv=${FLOOR_VENV:-.venv-torch-floor}
py=$venv/bin/python
what=${1:-all}

if [ "$what" = install ] || [ "$what" = all ]; then
  test -x "$py" || python3 -m venv "$venv"
  uv=.venv/bin/uv  # make install puts it there
  [ -x "$uv" ] || { "$py" -m pip install --quiet uv; uv=$venv/bin/uv; }
  "$uv" pip install --quiet --compile-bytecode --python "$py" "torch==$floor" -e '.[dev,hf]'
  "$py" -c "import torch; print('torch floor venv:', torch.__version__)"
fi
if [ "$what" = test ] || [ "$what" = all ]; then
  "$py" -m pytest -p no:cacheprovider -q --durations=5 \
    tests/test_layouts.py \
    "tests/test_checkpoint.py::test_resumed_run_continues_bit_for_bit[fsdp]" \
    tests/test_end_to_end.py::test_ddp_reports_speedup_against_measured_baseline
fi
