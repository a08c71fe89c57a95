#!/usr/bin/env bash
# `make test`: the fast suite, then the SLURM tests.
#
# The fast suite runs two test modules at a time (xdist --dist loadscope: a module's tests and
# its fixtures stay on one worker; tests/conftest.py orders the modules longest first) and
# keeps both cores busy on its own. The SLURM tests run after it: their jobs' ranks must
# start and train on time (the requeue test's job has a one-minute limit), and beside the
# fast suite they only added their CPU to its time. Measured on the 2-core box (issue 17):
# side by side, the fast suite niced, 817 s for both (the SLURM tests 220 s of it); the fast
# suite alone 494 s. Earlier, with a lighter fast suite, side by side had won (647 s against
# 716 s).
#
# .ci/run starts the SLURM cluster while the fast suite runs: MESHRUN_SLURM_STARTING names a
# file the start writes its exit status to when it ends, up or not (not up: the SLURM tests
# then fail, or skip without MESHRUN_REQUIRE_SLURM).
set -uo pipefail
python="${1:-.venv/bin/python}"

"$python" -m pytest -n 2 --dist loadscope -m "not slow and not slurm" --durations=30
fast_rc=$?

echo "=== SLURM tests ==="
if [ -n "${MESHRUN_SLURM_STARTING:-}" ]; then
    for _ in $(seq 900); do
        [ -e "$MESHRUN_SLURM_STARTING" ] && break
        sleep 1
    done
    echo "SLURM cluster start ended (status $(cat "$MESHRUN_SLURM_STARTING" 2>/dev/null ||
        echo 'none after 900 s'))"
fi
"$python" -m pytest -m "slurm and not slow" --durations=10
slurm_rc=$?
exit $((fast_rc != 0 || slurm_rc != 0))
