#!/usr/bin/env bash
# `make test`: the fast suite and the SLURM tests at the same time.
#
# The fast suite runs two test modules at a time (xdist --dist loadscope: a module's tests and
# its fixtures stay on one worker; tests/conftest.py orders the modules longest first) and
# keeps both cores busy. The SLURM tests mostly wait (sbatch, sacct, a requeued job's time
# limit), but their jobs' ranks must start and train on time: the requeue test's job has a
# one-minute limit. So the fast suite runs in a session of its own whose autogroup (the
# kernel's per-session CPU share, which plain nice does not cross) is niced to 19: it takes
# the CPU the SLURM tests leave. Measured on the 2-core box: 647 s for both instead of 716 s
# one after the other, the SLURM tests 249 s instead of 232 s.
set -uo pipefail
python="${1:-.venv/bin/python}"
slurm_log="$(mktemp "${TMPDIR:-/tmp}/meshrun-slurm-tests.XXXXXX")"

setsid bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null || renice -n 19 $$ >/dev/null
    exec "$0" -m pytest -n 2 --dist loadscope -m "not slow and not slurm" --durations=30' \
    "$python" &
fast=$!
# Its own session does not get the terminal's Ctrl-C: pass it on, and never leave it behind.
trap 'kill -INT -- -"$fast" 2>/dev/null; wait "$fast"; rm -f "$slurm_log"; exit 130' INT TERM

# .ci/run starts the SLURM cluster beside the fast suite: it names a file the start writes its
# exit status to when it ends, up or not (not up: the SLURM tests then fail or skip).
if [ -n "${MESHRUN_SLURM_STARTING:-}" ]; then
    for _ in $(seq 900); do
        [ -e "$MESHRUN_SLURM_STARTING" ] && break
        sleep 1
    done
    echo "SLURM cluster start ended (status $(cat "$MESHRUN_SLURM_STARTING" 2>/dev/null ||
        echo 'none after 900 s'))" >>"$slurm_log"
fi
"$python" -m pytest -m "slurm and not slow" --durations=10 >>"$slurm_log" 2>&1
slurm_rc=$?
wait "$fast"
fast_rc=$?
echo "=== SLURM tests (run beside the fast suite) ==="
cat "$slurm_log"
rm -f "$slurm_log"
exit $((fast_rc != 0 || slurm_rc != 0))
