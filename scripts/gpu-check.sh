#!/usr/bin/env bash
# The GPU checks in one go, for a machine with CUDA (run from the repository root):
# the gpu-marked tests, predicted vs measured memory on CUDA, MFU and tokens/s of llama-1b
# and hf/llama-3.2-1b in bf16 on one GPU with and without torch.compile, an MoE (grouped GEMM), a profiled step
# and allocator snapshots (debug.profile_steps, debug.memory_snapshot), FSDP and TP memory
# on NCCL (2+ GPUs), expert parallelism (ep2, tp2 x etp, ep2 verified against one GPU; 2+ GPUs), context parallelism's memory and tokens/s against one GPU
# (benchmarks/context_parallel.py, 2+ GPUs), a hang's flight-recorder account on NCCL (2+ GPUs), torchft replicas
# on NCCL with one killed (2+ GPUs), the pipeline bubble on a host with CPU cores to
# spare, and meshrun-comm over nccl (all-reduce busbw) with meshrun-doctor (2+ GPUs).
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

# On an image without network: meshrun's needs from wheels built ahead
# (scripts/build-gpu-wheels.sh) and carried with the tree, installed offline; the image's own
# torch stays (no torch wheel is there).
wheels=${WHEELS:-outputs/gpu-wheels}
if [ -f "$wheels/requirements.txt" ]; then
  log "installing meshrun's needs offline from $wheels"
  $py -m pip install -q --no-index --find-links "$wheels" -r "$wheels/requirements.txt" 2>&1 \
    | tail -5 || log "FAILED: the offline install from $wheels (the checks below may not import)"
fi

log "gpu tests"
# Every gpu-marked test where wandb is installed; test_gpu.py alone where it is not.
gpu_tests=tests/test_gpu.py
$py -c "import wandb" 2>/dev/null && gpu_tests=tests/
$py -m pytest -q -p no:cacheprovider -s -m gpu $gpu_tests 2>&1 | tee "$out/gpu_tests.log" | tail -25

gpus=$(nvidia-smi -L | wc -l)
work=$(mktemp -d)
# One meshrun run ($1: a label, the rest its overrides); its results.json summarised.
run() {
  local label=$1; shift
  local dir="$work/$(echo "$label" | tr ' =/' '_-_')"
  $py -m meshrun logger=none train.progress_bar=false metrics.baseline=off \
    "hydra.run.dir=$dir" "store.path=$work/meshrun.db" "$@" > "$dir.log" 2>&1 \
    || { log "FAILED: $label: $*"; tail -5 "$dir.log"; return; }
  $py - "$dir/results.json" "$label" <<'PY' | tee -a "$out/summary.log"
import json, sys
r = json.load(open(sys.argv[1]))
cells = []
for m, p in zip(r["memory_per_rank"], r["memory_predicted"] or []):
    cells.append(" ".join(f"{k} {m[k] / 2**20:.0f}/{p[k] / 2**20:.0f}" for k in
                          ("peak", "params", "grads", "optimizer", "activations", "other")
                          if k in m)
                 + f"; reserved {m.get('reserved', 0) / 2**20:.0f}")
mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
compile_s = r.get("compile_s")
print(f"{sys.argv[2]}: {r['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, step {r['step_time_s']:.4f}s "
      f"(predicted {r['predicted_step_time_s'] or 0:.4f}s"
      + (", calibrated" if r.get("predicted_calibrated_at") else "") + ")"
      + (f", compile {compile_s:.1f}s" if compile_s is not None else "")
      + "".join(f"\n    rank {i} MiB measured/predicted {c}" for i, c in enumerate(cells)))
PY
}

log "CUDA memory: predicted vs measured (one GPU)"
run "small fp32" parallel=single train.steps=6 train.untimed_steps=2 model=small train.precision=fp32
run "gpt2-124m bf16" parallel=single train.steps=6 train.untimed_steps=2 model=gpt2-124m \
  train.precision=bf16 train.seq_len=1024 train.micro_batch_size=4
run "llama-1b bf16 ckpt=full" parallel=single train.steps=6 train.untimed_steps=2 model=llama-1b \
  train.precision=bf16 train.seq_len=2048 train.micro_batch_size=2 parallel.activation_checkpointing=full

log "mixture of experts on one GPU, bf16 (grouped GEMM on sm90+): memory measured/predicted, MFU of active experts"
run "tiny-moe bf16" parallel=single train.steps=10 train.untimed_steps=2 model=tiny-moe \
  train.precision=bf16 train.seq_len=1024
run "mixtral-shaped 2 layers bf16" parallel=single train.steps=6 train.untimed_steps=2 model=mixtral-8x7b \
  model.n_layers=2 model.dim=1024 model.n_heads=8 model.n_kv_heads=8 model.ffn_dim=3584 \
  train.precision=bf16 train.seq_len=1024 train.micro_batch_size=2 train.global_batch_size=8

log "inside a step on CUDA: llama-1b bf16 profiled (steps 4-5), the step split by the device's kernels"
run "llama-1b profiled" parallel=single train.steps=8 train.untimed_steps=2 model=llama-1b \
  train.precision=bf16 train.seq_len=2048 train.micro_batch_size=2 'debug.profile_steps=[4,5]' \
  debug.memory_snapshot=true
prof_dir=$(ls -d "$work"/llama-1b_profiled 2>/dev/null)
[ -n "$prof_dir" ] && $py -c "
import json, sys; r = json.load(open(sys.argv[1]))
print('profile overhead', r['profile_overhead'], [{k: v for k, v in p.items() if k != 'timeline'} for p in r['profile'] or []])
" "$prof_dir/results.json" | tee -a "$out/summary.log" && cp -r "$prof_dir/profile" "$out/profile-llama-1b"

log "meshrun-plan calibrate on the GPU(s): matmul, attention, memory, op dispatch, TP/FSDP2's host cost on an NCCL mesh of the GPUs, less their collectives alone, each checkpointing policy's and each CP method's (and NCCL's all-reduce/all-gather/reduce-scatter at every size, 4 KiB-16 MiB, with 2+)"
$py -m meshrun.tools.plan.main calibrate model=llama-1b hardware=auto train.precision=bf16 \
  train.seq_len=2048 train.micro_batch_size=4 "store.path=$work/meshrun.db" 2>&1 \
  | tee "$out/calibrate.log" | tail -3

log "throughput: MFU and tokens/s on one GPU, bf16, with and without torch.compile (target MFU >= 45% on H100/H200)"
for model in llama-1b hf/llama-3.2-1b; do
  for compiled in false true; do
    run "$model compile=$compiled" parallel=single "model=$model" train.precision=bf16 \
      train.seq_len=2048 train.micro_batch_size=4 train.global_batch_size=8 train.steps=30 \
      train.untimed_steps=5 "train.compile=$compiled"
  done
done

if [ "$gpus" -ge 2 ]; then
  log "FSDP and TP on NCCL, 2 GPUs: memory measured/predicted, tokens/s"
  for layout in fsdp tp2; do
    run "llama-1b $layout nccl" "parallel=$layout" model=llama-1b backend=nccl launcher.nproc_per_node=2 \
      train.precision=bf16 train.seq_len=2048 train.micro_batch_size=2 train.global_batch_size=8 \
      train.steps=10 train.untimed_steps=3
  done
  log "expert parallelism on NCCL, 2 GPUs: ep2 and tp2 x etp (bf16 tokens/s, memory), ep2 against one GPU (fp32)"
  moe=(model=mixtral-8x7b model.n_layers=2 model.dim=1024 model.n_heads=8 model.n_kv_heads=8
       model.ffn_dim=3584 backend=nccl launcher.nproc_per_node=2 train.precision=bf16
       train.seq_len=1024 train.micro_batch_size=2 train.global_batch_size=8 train.steps=8
       train.untimed_steps=2)
  run "mixtral-shaped ep2 nccl" parallel=ep2 "${moe[@]}"
  run "mixtral-shaped tp2 etp nccl" parallel=tp2 parallel.etp=2 "${moe[@]}"
  $py -m meshrun.tools.verify model=tiny-moe parallel=ep2 backend=nccl launcher.nproc_per_node=2 \
    2>&1 | tee "$out/verify_ep2_nccl.log" | tail -3
  log "a tied embedding across 2 pipeline stages on NCCL (the ends' gradients summed): against one GPU"
  $py -m meshrun.tools.verify model=tiny model.tie_embeddings=true parallel=pp2 backend=nccl \
    launcher.nproc_per_node=2 2>&1 | tee "$out/verify_tied_pp2_nccl.log" | tail -3
  log "a hang on NCCL (rank 1 stops at step 2): the message names the collective from NCCL's flight recorder"
  hang="$work/hang-nccl"
  $py -m meshrun logger=none train.progress_bar=false metrics.baseline=off parallel=ddp model=tiny \
    backend=nccl launcher.nproc_per_node=2 train.steps=6 debug.fail_rank=1 debug.fail_step=2 \
    debug.fail_mode=hang backend.timeout_s=20 "hydra.run.dir=$hang" "store.path=$work/meshrun.db" \
    > "$out/hang_nccl.log" 2>&1
  grep -o "collective hang.*" "$out/hang_nccl.log" | head -1 | tee -a "$out/summary.log"
  ls "$hang/flight_recorder" 2>&1 | tee -a "$out/summary.log"
  log "torchft on NCCL, 2 GPUs: replica 1 killed at step 10, the other trains on, it rejoins"
  run "tiny torchft nccl kill" parallel=ddp model=tiny backend=nccl launcher.nproc_per_node=2 \
    parallel.fault_tolerance=torchft train.steps=60 train.untimed_steps=2 debug.fail_rank=1 \
    debug.fail_step=10 debug.fail_mode=kill debug.slow_step_s=0.05 parallel.replica_restart_delay_s=2
  [ -f "$work/tiny_torchft_nccl_kill/results.json" ] && $py -c "
import json, sys; r = json.load(open(sys.argv[1]))
print('torchft:', r['status'], r['replica_failures'], r['steps_with_fewer_replicas'], 'steps with fewer replicas')
" "$work/tiny_torchft_nccl_kill/results.json" | tee -a "$out/summary.log"
else
  log "FSDP, TP and EP on NCCL: skipped, $gpus GPU here (NCCL needs a GPU a rank)"
fi

if [ "$gpus" -ge 4 ]; then
  log "a hang in a TP group of a 2-D mesh on NCCL (tp2 x pp2): ends at backend.timeout_s, not torch's 10-minute default for sub-groups"
  hang2d="$work/hang-nccl-tp2-pp2"
  SECONDS=0
  $py -m meshrun logger=none train.progress_bar=false metrics.baseline=off parallel=tp2_pp2 model=tiny \
    backend=nccl launcher.nproc_per_node=4 train.steps=6 debug.fail_rank=1 debug.fail_step=2 \
    debug.fail_mode=hang backend.timeout_s=20 "hydra.run.dir=$hang2d" "store.path=$work/meshrun.db" \
    > "$out/hang_nccl_tp2_pp2.log" 2>&1
  echo "tp2 x pp2 hang ended after ${SECONDS}s (timeout 20 s)" | tee -a "$out/summary.log"
else
  log "a hang in a 2-D mesh's TP group on NCCL: skipped, $gpus GPU here (needs 4)"
fi

if [ "$gpus" -ge 2 ]; then
  log "context parallelism on NCCL, 2 GPUs: cp2 under each method against one GPU"
  $py benchmarks/context_parallel.py 4096 16384 --cap-mib 2048 2>&1 | tee "$out/context_parallel.log" | tail -30
else
  log "context parallelism: skipped, $gpus GPU here (cp2 needs a GPU a rank)"
fi

log "pipeline bubble on $(nproc) CPU cores"
$py -m pytest -q -p no:cacheprovider -s -m slow -k bubble tests/test_pipeline.py 2>&1 \
  | tee "$out/bubble.log" | grep -E "^bubble|passed|failed|skipped"

if [ "$gpus" -ge 2 ]; then
  log "meshrun-comm backend=nccl (all-reduce busbw)"
  $py -m meshrun.tools.comm.main backend=nccl 2>&1 | tee "$out/comm_nccl.log" | tail -40
  log "meshrun-doctor"
  $py -m meshrun.tools.doctor.main 2>&1 | tee "$out/doctor.log" | tail -60
else
  log "meshrun-comm over nccl: skipped, $gpus GPU here"
fi
