#!/usr/bin/env bash
# The fast subset on the oldest torch meshrun is tested on (the floor): the layouts that
# compose the most of torch's distributed APIs (3-D, FSDP2 x CP, zero bubble, selective
# checkpointing, a tied pipeline) against one device, a checkpoint resume (FSDP2, sharded
# DCP), the CLI (the quick start, DDP with its measured baseline), the zero-bubble rule's
# torch limitation and float8 (torchao 0.18 loads on torch 2.11; its rowwise
# recipes skip there: 2.11's CPU _scaled_mm takes one scale a tensor), and Liger's fused
# cross-entropy (train.loss_kernel) in Triton's interpreter on the CPU (this venv's CUDA torch
# brings Triton; MESHRUN_REQUIRE_LIGER=1 fails the test rather than skips it), in a venv of its
# own beside make install's .venv. NumPy below 2.4: Triton 3.6's interpreter turns a
# one-element array into a Python int (runtime/interpreter.py, `__index__`), which 2.4 refuses.
#
#   scripts/test-torch-floor.sh install   # the venv: torch $floor, meshrun[dev,hf,float8,liger]
#   scripts/test-torch-floor.sh test      # the subset in it
#   scripts/test-torch-floor.sh           # both
#
# PyPI's Linux torch below the CPU wheel make install uses is a CUDA build: it imports and
# runs on the CPU, but only with its nvidia-* packages (libcudnn, libcublas, ... are linked
# in). There is no +cpu build of 2.11 on PyPI, and PyTorch's own index is not reachable from
# CI. .ci/run runs both steps: the install in the background beside the fast suite, the
# subset beside the last SLURM tests (scripts/run-tests.sh). Measured on the 2-core box
# (torch 2.11.0+cu130): install 34 s from a cold uv cache (4.4 GB into the cache, 56 CPU
# seconds); the subset 39-43 s alone, 63 s beside the SLURM tests (87 s for both).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${FLOOR_VENV:-.venv-torch-floor}
py=$venv/bin/python
what=${1:-all}
# The floor meshrun refuses below (core/torch_floor.py), unless another is asked for.
floor=${MESHRUN_TORCH_FLOOR:-$(sed -n 's/^TORCH_FLOOR = "\(.*\)"$/\1/p' src/meshrun/core/torch_floor.py)}

if [ "$what" = install ] || [ "$what" = all ]; then
  test -x "$py" || python3 -m venv "$venv"
  uv=.venv/bin/uv  # make install puts it there
  [ -x "$uv" ] || { "$py" -m pip install --quiet uv; uv=$venv/bin/uv; }
  "$uv" pip install --quiet --compile-bytecode --python "$py" "torch==$floor" "numpy<2.4" -e '.[dev,hf,float8,liger]'
fi
if [ "$what" = test ] || [ "$what" = all ]; then
  installed=$("$py" -c "import torch; print(torch.__version__)")
  case $installed in
    "$floor" | "$floor".* | "$floor"+*) echo "torch floor venv: torch $installed" ;;
    *) echo "$0: $venv has torch $installed, not the floor $floor" >&2; exit 1 ;;
  esac
  MESHRUN_REQUIRE_LIGER=1 "$py" -m pytest -p no:cacheprovider -q --durations=5 \
    "tests/test_layouts.py::test_layout_losses_and_grad_norms_match_single_device[dp2_tp2_pp2]" \
    "tests/test_layouts.py::test_layout_losses_and_grad_norms_match_single_device[fsdp2_cp2]" \
    "tests/test_layouts.py::test_layout_losses_and_grad_norms_match_single_device[pp2_interleaved_zero_bubble]" \
    "tests/test_layouts.py::test_layout_losses_and_grad_norms_match_single_device[fsdp_selective_checkpointing]" \
    "tests/test_layouts.py::test_a_tied_embedding_trains_across_pipeline_stages_as_on_one_device[fsdp2_pp2_interleaved]" \
    "tests/test_checkpoint.py::test_resumed_run_continues_bit_for_bit[fsdp]" \
    tests/test_end_to_end.py::test_ddp_reports_speedup_against_measured_baseline \
    "tests/test_float8.py::test_float8_layout_matches_float8_on_one_device[fsdp2_tp2_sequence_parallel]" \
    tests/test_loss_kernel.py::test_liger_kernel_gives_torchs_loss_and_gradients_under_tritons_interpreter
fi
