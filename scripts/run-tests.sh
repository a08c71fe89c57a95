#!/usr/bin/env bash
# `make test`: the fast suite, with the tests that mostly wait on a clock beside it, then the
# other SLURM tests (in CI with the torch floor's subset beside them).
#
# The fast suite runs two test modules at a time (xdist --dist loadscope: a module's tests and
# its fixtures stay on one worker; tests/conftest.py orders the modules longest first) and
# keeps both cores busy on its own. Beside it run only the tests marked `waits`: a hang's
# timeout (the backend's, the watchdog's, the doctor's), a requeued SLURM job's one-minute
# time limit with steps that sleep. They take little CPU, but their ranks must start and
# reach the clock on time, so the fast suite runs in a session of its own whose autogroup
# (the kernel's per-session CPU share, which plain nice does not cross) is niced to 19. The
# other SLURM tests (jobs that import torch and train: CPU) run after it. Measured on the
# 2-core box (issue 17): every SLURM test beside the niced fast suite, 817 s for both; the
# fast suite alone 484 s, then the SLURM tests 206 s; this way 565 s (the fast suite 492 s,
# the two waiting SLURM tests 137 s beside it, the seven others 63 s after), .ci/run 593 s.
#
# .ci/run starts the SLURM cluster while the fast suite runs: MESHRUN_SLURM_STARTING names a
# file the start writes its exit status to when it ends, up or not (not up: the SLURM tests
# then fail, or skip without MESHRUN_REQUIRE_SLURM). It also installs the torch floor's venv
# (scripts/test-torch-floor.sh): MESHRUN_FLOOR_INSTALLING names the file of that install's
# exit status, and the floor's subset then runs beside the other SLURM tests, which wait on
# their jobs' scheduling part of the time (measured here: 87 s for both, 115 one after the
# other).
set -uo pipefail
python="${1:-.venv/bin/python}"
waits_log="$(mktemp "${TMPDIR:-/tmp}/meshrun-slurm-tests.XXXXXX")"

setsid bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null || renice -n 19 $$ >/dev/null
    exec "$0" -m pytest -n 2 --dist loadscope -m "not slow and not slurm and not waits" \
        --durations=30' \
    "$python" &
fast=$!
# Its own session does not get the terminal's Ctrl-C: pass it on, and never leave it behind.
trap 'kill -INT -- -"$fast" 2>/dev/null; wait "$fast"; rm -f "$waits_log"; exit 130' INT TERM

"$python" -m pytest -m "waits and not slurm and not slow" --durations=5 >"$waits_log" 2>&1
hangs_rc=$?
if [ -n "${MESHRUN_SLURM_STARTING:-}" ]; then
    for _ in $(seq 900); do
        [ -e "$MESHRUN_SLURM_STARTING" ] && break
        sleep 1
    done
    echo "SLURM cluster start ended (status $(cat "$MESHRUN_SLURM_STARTING" 2>/dev/null ||
        echo 'none after 900 s'))" >>"$waits_log"
fi
"$python" -m pytest -m "slurm and waits and not slow" --durations=5 >>"$waits_log" 2>&1
waits_rc=$?
wait "$fast"
fast_rc=$?
echo "=== tests that wait on a clock (run beside the fast suite) ==="
cat "$waits_log"
rm -f "$waits_log"
floor= floor_rc=0
floor_log="$(mktemp "${TMPDIR:-/tmp}/meshrun-floor-tests.XXXXXX")"
if [ -n "${MESHRUN_FLOOR_INSTALLING:-}" ]; then
    for _ in $(seq 900); do
        [ -e "$MESHRUN_FLOOR_INSTALLING" ] && break
        sleep 1
    done
    if [ "$(cat "$MESHRUN_FLOOR_INSTALLING" 2>/dev/null)" = 0 ]; then
        scripts/test-torch-floor.sh test >"$floor_log" 2>&1 &
        floor=$!
    else
        echo "the torch floor's venv did not install (status $(cat "$MESHRUN_FLOOR_INSTALLING" \
            2>/dev/null || echo 'none after 900 s'))" >"$floor_log"
        floor_rc=1
    fi
fi
echo "=== the other SLURM tests ==="
"$python" -m pytest -m "slurm and not waits and not slow" --durations=10
slurm_rc=$?
if [ -n "$floor" ]; then
    wait "$floor"
    floor_rc=$?
fi
if [ -n "${MESHRUN_FLOOR_INSTALLING:-}" ]; then
    echo "=== the fast subset on the torch floor (run beside the SLURM tests) ==="
    cat "$floor_log"
fi
rm -f "$floor_log"
exit $((fast_rc != 0 || hangs_rc != 0 || waits_rc != 0 || slurm_rc != 0 || floor_rc != 0))
