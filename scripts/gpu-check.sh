#!/usr/bin/env bash
# The GPU checks in one go, for a machine with CUDA (run from the repository root):
# the gpu-marked tests, predicted vs measured memory on CUDA, the pipeline bubble on a host
# with CPU cores to spare, and meshrun-comm over nccl with meshrun-doctor when present.
# Logs go to $OUT (default outputs/gpu-check). Uses the python on PATH (PYTHON=...), with the
# repository's src/ on PYTHONPATH, so a machine's own CUDA torch is used as it is.
set -uo pipefail
out=${OUT:-outputs/gpu-check}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log() { echo "== $*" | tee -a "$out/summary.log"; }

log "host: $(nproc) cores; $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" | tee -a "$out/summary.log"

log "gpu tests"
# Every gpu-marked test where wandb is installed; test_gpu.py alone where it is not.
gpu_tests=tests/test_gpu.py
$py -c "import wandb" 2>/dev/null && gpu_tests=tests/
$py -m pytest -q -p no:cacheprovider -s -m gpu $gpu_tests 2>&1 | tee "$out/gpu_tests.log" | tail -25

log "CUDA memory: predicted vs measured"
work=$(mktemp -d)
for args in "model=small train.precision=fp32" \
            "model=gpt2-124m train.precision=bf16 train.seq_len=1024 train.micro_batch_size=4" \
            "model=llama-1b train.precision=bf16 train.seq_len=2048 train.micro_batch_size=2" \
            "model=llama-1b train.precision=bf16 train.seq_len=2048 train.micro_batch_size=2 parallel.activation_checkpointing=full"; do
  dir="$work/$(echo "$args" | tr ' =/' '_-_')"
  $py -m meshrun parallel=single logger=none train.progress_bar=false metrics.baseline=false \
    train.steps=6 train.untimed_steps=2 "hydra.run.dir=$dir" "store.path=$work/meshrun.db" $args \
    > "$dir.log" 2>&1 || { log "FAILED: $args"; tail -5 "$dir.log"; continue; }
  $py - "$dir/results.json" "$args" <<'PY' | tee -a "$out/summary.log"
import json, sys
r = json.load(open(sys.argv[1]))
m, p = r["memory_per_rank"][0], r["memory_predicted"][0]
cells = " ".join(f"{k} {m[k] / 2**20:.0f}/{p[k] / 2**20:.0f}" for k in ("peak", "params", "grads", "optimizer", "activations", "other"))
print(f"{sys.argv[2]}: MiB measured/predicted {cells}; reserved {m['reserved'] / 2**20:.0f}; "
      f"step {r['step_time_s']:.4f}s predicted {r['predicted_step_time_s']:.4f}s; mfu {r['mfu']}")
PY
done

log "pipeline bubble on $(nproc) CPU cores"
$py -m pytest -q -p no:cacheprovider -s -m slow -k bubble tests/test_pipeline.py 2>&1 \
  | tee "$out/bubble.log" | grep -E "^bubble|passed|failed|skipped"

if $py -c "import meshrun.diag" 2>/dev/null; then
  log "meshrun-comm backend=nccl"
  $py -m meshrun.tools.comm.main backend=nccl 2>&1 | tee "$out/comm_nccl.log" | tail -40
  log "meshrun-doctor"
  $py -m meshrun.tools.doctor.main 2>&1 | tee "$out/doctor.log" | tail -60
fi
