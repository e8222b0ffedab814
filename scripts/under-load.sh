#!/usr/bin/env bash
# The whole suite, several times in a row, while other processes keep every CPU busy:
# a test that depends on the machine's load or on timing fails here. Each run is
# scripts/test.sh (setup, the checks, every test, APERF_REQUIRE_BPF=1: as root). Stops
# at the first failing run, says which, and exits with its status.
#
#   scripts/under-load.sh [--runs N] [-- ARGS...]
#
# --runs N: how many runs (default 3). ARGS go to pytest through test.sh, e.g.
# `scripts/under-load.sh --runs 1 -- tests/unit/test_options.py` checks this script.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    echo "usage: scripts/under-load.sh [--runs N] [-- PYTEST-ARGS...]" >&2
    exit 2
}

runs=3
while [ $# -gt 0 ]; do
    case "$1" in
        --runs)
            [ $# -ge 2 ] || usage
            runs=$2
            shift 2
            ;;
        --runs=*)
            runs=${1#--runs=}
            shift
            ;;
        --)
            shift
            break
            ;;
        *)
            echo "under-load.sh: unknown argument '$1' (pytest's go after --)" >&2
            usage
            ;;
    esac
done
case "$runs" in
    '' | *[!0-9]* | 0)
        echo "under-load.sh: --runs needs a whole number of at least 1, not '$runs'" >&2
        exit 2
        ;;
esac
runs=$((10#$runs))  # 08 is eight, not a bad octal number

# One busy process per CPU this script may run on, killed however the script ends; and
# a run cut short by a signal is ended with everything it started (its own session).
busy=()
run_pid=
stop_all() {
    local pid
    if [ -n "$run_pid" ]; then
        kill -TERM -- "-$run_pid" 2>/dev/null || true
        wait "$run_pid" 2>/dev/null || true
    fi
    for pid in "${busy[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${busy[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
cpus=$(nproc)
for ((i = 0; i < cpus; i++)); do
    yes >/dev/null &
    busy+=("$!")
done

load_running() {
    local pid
    for pid in "${busy[@]}"; do
        kill -0 "$pid" 2>/dev/null || return 1
    done
}

for ((run = 1; run <= runs; run++)); do
    echo "under-load.sh: run $run of $runs, with $cpus busy processes on $cpus CPUs" >&2
    start=$SECONDS
    status=0
    # In the background, and waited for: a signal then reaches the traps at once.
    setsid bash scripts/test.sh "$@" &
    run_pid=$!
    wait "$run_pid" || status=$?
    run_pid=
    if [ "$status" -ne 0 ]; then
        echo "under-load.sh: run $run of $runs FAILED (exit status $status)" >&2
        exit "$status"
    fi
    if ! load_running; then
        echo "under-load.sh: run $run of $runs passed, but a busy process had ended:" \
            "the CPUs were not kept busy" >&2
        exit 1
    fi
    echo "under-load.sh: run $run of $runs passed in $((SECONDS - start)) s" >&2
done
echo "under-load.sh: all $runs runs passed with every CPU kept busy" >&2
