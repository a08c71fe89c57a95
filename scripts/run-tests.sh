#!/usr/bin/env bash
# `make test`: the fast suite on two xdist workers and, at the same time, the SLURM tests on
# their own (serially: their jobs share the two-node cluster). The SLURM tests mostly wait
# (for sbatch, sacct, a requeued job's time limit), so beside the other pass they cost it
# little; one after the other they added 4-5 min. The fast pass runs at the lowest CPU
# priority: when a SLURM job runs (under slurmd, at normal priority) it gets the cores
# first, as on an idle box; without that, the requeue test's attempts spent their minute
# importing torch. Their output follows the first pass's.
set -uo pipefail
python="${1:-.venv/bin/python}"
slurm_log="$(mktemp "${TMPDIR:-/tmp}/meshrun-slurm-tests.XXXXXX")"
"$python" -m pytest -m "slurm and not slow" --durations=10 >"$slurm_log" 2>&1 &
slurm=$!
nice -n 19 "$python" -m pytest -n 2 --dist loadscope -m "not slow and not slurm" --durations=60
fast=$?
wait "$slurm"
slurm_rc=$?
echo "=== SLURM tests ==="
cat "$slurm_log"
rm -f "$slurm_log"
exit $((fast != 0 || slurm_rc != 0))
