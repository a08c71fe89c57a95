#!/usr/bin/env bash
# `make test`: the fast suite, with every other test of CI in one lane beside it: the tests
# that mostly wait on a clock, then the SLURM tests, then (in CI) the torch floor's subset.
#
# The fast suite runs two test modules at a time (xdist --dist loadscope: a module's tests and
# its fixtures stay on one worker; tests/conftest.py orders the modules longest first) and
# keeps both cores busy on its own. It runs in a session of its own whose autogroup (the
# kernel's per-session CPU share, which plain nice does not cross) is niced to 19, so that the
# lane beside it gets the CPU whenever it asks: its tests must reach their clocks on time (a
# hang's timeout, a requeued SLURM job's one-minute time limit), and its other work leaves
# cores idle while SLURM schedules a job or a test waits on one, which the fast suite then
# takes. The lane, in order:
#   1. the tests marked `waits` (not SLURM): a hang's timeout (backend, watchdog, doctor);
#   2. the SLURM tests marked `waits` (a requeue's time limit, a hang), once the cluster is up;
#   3. the other SLURM tests (jobs that import torch and train), with the torch floor's subset
#      beside them in CI (scripts/test-torch-floor.sh; its install must have ended with 0).
# Measured on the 2-core box (CI on a fresh clone): the lane ~390 s inside the fast suite's
# ~520, CI 549 s (with libgomp's spin-waits, tests/__init__.py, the fast suite took ~690-760
# and CI 745-801 s); with step 3 after the fast suite (as before), CI ended 95 s after it.
#
# .ci/run starts the SLURM cluster while the fast suite runs: MESHRUN_SLURM_STARTING names a
# file the start writes its exit status to when it ends, up or not (not up: the SLURM tests
# then fail, or skip without MESHRUN_REQUIRE_SLURM). It also installs the torch floor's venv:
# MESHRUN_FLOOR_INSTALLING names the file of that install's exit status.
set -uo pipefail
python="${1:-.venv/bin/python}"
lane_log="$(mktemp "${TMPDIR:-/tmp}/meshrun-lane-tests.XXXXXX")"
floor_log="$(mktemp "${TMPDIR:-/tmp}/meshrun-floor-tests.XXXXXX")"

setsid bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null || renice -n 19 $$ >/dev/null
    exec "$0" -m pytest -n 2 --dist loadscope -m "not slow and not slurm and not waits" \
        --durations=30' \
    "$python" &
fast=$!
# Its own session does not get the terminal's Ctrl-C: pass it on, and never leave it behind.
trap 'kill -INT -- -"$fast" 2>/dev/null; wait "$fast"; rm -f "$lane_log" "$floor_log"; exit 130' \
    INT TERM

# Waits up to 900 s for the file a background start writes its exit status to.
ended() {
    for _ in $(seq 900); do
        [ -e "$1" ] && break
        sleep 1
    done
    cat "$1" 2>/dev/null || echo "none after 900 s"
}

# One pytest of the lane, its output under a title in the lane's log.
lane() {
    local title=$1
    shift
    { echo "=== $title ==="; "$python" -m pytest "$@"; } >>"$lane_log" 2>&1
}

lane "tests that wait on a clock" -m "waits and not slurm and not slow" --durations=5
hangs_rc=$?
if [ -n "${MESHRUN_SLURM_STARTING:-}" ]; then
    echo "SLURM cluster start ended (status $(ended "$MESHRUN_SLURM_STARTING"))" >>"$lane_log"
fi
lane "SLURM tests that wait on a clock" -m "slurm and waits and not slow" --durations=5
waits_rc=$?
floor= floor_rc=0
if [ -n "${MESHRUN_FLOOR_INSTALLING:-}" ]; then
    installed=$(ended "$MESHRUN_FLOOR_INSTALLING")
    if [ "$installed" = 0 ]; then
        scripts/test-torch-floor.sh test >"$floor_log" 2>&1 &
        floor=$!
    else
        echo "the torch floor's venv did not install (status $installed)" >"$floor_log"
        floor_rc=1
    fi
fi
lane "the other SLURM tests" -m "slurm and not waits and not slow" --durations=10
slurm_rc=$?
if [ -n "$floor" ]; then
    wait "$floor"
    floor_rc=$?
fi
wait "$fast"
fast_rc=$?
echo "=== beside the fast suite ==="
cat "$lane_log"
if [ -n "${MESHRUN_FLOOR_INSTALLING:-}" ]; then
    echo "=== the fast subset on the torch floor ==="
    cat "$floor_log"
fi
rm -f "$lane_log" "$floor_log"
exit $((fast_rc != 0 || hangs_rc != 0 || waits_rc != 0 || slurm_rc != 0 || floor_rc != 0))
