#!/usr/bin/env bash
# The fast check, as any user: lint, types, the docs site, and the tests that need
# no BPF. No root, no apt, no mount, no make. The tests are selected with
#   pytest -m "not kernel and not packaging"
# where "kernel" is set on every test that takes the kernel fixture (tests/conftest.py)
# and "packaging" marks the wheel build tests; then the pure path's subset again, with
# APERF_NO_EXTENSIONS=1 (both paths are tested on every run). scripts/test.sh is the full
# run (root): it runs this script with --all, which deselects nothing and runs the kernel
# tier and the rest side by side (two pytest processes; arguments after --all go to both).
set -euo pipefail
cd "$(dirname "$0")/.."
selection=(-m "not kernel and not packaging")
all=0
if [ "${1:-}" = "--all" ]; then
    shift
    selection=()
    all=1
fi
PYTHON=.venv/bin/python
if [ ! -x "$PYTHON" ]; then
    # An editable install compiles nothing (bpf/build_hook.py): no clang needed here.
    "${BASE_PYTHON:-python3}" -m venv .venv
    "$PYTHON" -m pip install -q --disable-pip-version-check -e '.[test,service,docs]'
fi

"$PYTHON" -m ruff check aperf tests examples bench scripts bpf
"$PYTHON" -m mypy aperf tests/typecheck
# The drivers' shared keyword text and overloads, as scripts/driver_keywords.py writes them.
"$PYTHON" scripts/driver_keywords.py --check
# The docs site and its API reference, warnings as errors, built into a temporary
# directory (never into the checkout). tests/docs/test_docs.py runs the pages' snippets.
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
"$PYTHON" -m mkdocs build --strict --site-dir "$site"

pytest() {
    "$PYTHON" -m pytest -q -p no:cacheprovider "$@"
}
if [ ${#selection[@]} -gt 0 ]; then
    status=0
    pytest "${selection[@]}" "$@" || status=$?
else
    # Everything: the kernel tier in one pytest, one test at a time as ever, and the
    # rest (no BPF: fakes, servers, a browser, the docs, the wheels) in a second pytest
    # beside it, printed when it ends. Most tests wait (for a child, a server, the
    # kernel) more than they compute, so the two overlap well on two CPUs.
    others_log=$(mktemp)
    trap 'rm -rf "$site" "$others_log"' EXIT
    pytest -m "not kernel" "$@" >"$others_log" 2>&1 &
    others=$!
    kernel_status=0
    pytest -m kernel "$@" || kernel_status=$?
    others_status=0
    wait "$others" || others_status=$?
    echo "--- the tests that need no BPF (pytest -m 'not kernel'), run beside the kernel tier:"
    cat "$others_log"
    # Exit status 5 is "collected nothing": fine for one of the two runs (arguments may
    # name only kernel tests, or none), not for both.
    if [ "$kernel_status" -eq 5 ] && [ "$others_status" -eq 5 ]; then
        status=5
    elif [ "$kernel_status" -ne 0 ] && [ "$kernel_status" -ne 5 ]; then
        status=$kernel_status
    elif [ "$others_status" -ne 0 ] && [ "$others_status" -ne 5 ]; then
        status=$others_status
    else
        status=0
    fi
fi
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure" >&2
    exit 1
fi
# The run above takes aperf's compiled fast path (aperf/_native/_speedups.c, built by the
# editable install). The pure path, the reference it stands in for, runs again on what it
# replaces: the record formats, the decoders and builders, the reader, the drivers on
# every loop and, with --all, a kernel subset with every reading mode (async for,
# batches, callbacks, arrays, leases, time order, the sync buffer) on every loop, with
# wraps and losses. About 50 s on 2 busy CPUs: the kernel files' slow tests of other
# things (fd leaks over 100 opens, a 5 s cancel scope) are left to the run above.
if [ "$status" -eq 0 ] && [ $# -eq 0 ]; then
    PURE=(tests/unit/test_perf_format.py tests/unit/test_ringbuf_format.py
          tests/unit/test_decoders.py tests/unit/test_reader.py tests/unit/test_stream_drivers.py
          tests/unit/test_fake_source.py tests/unit/test_columnar.py tests/unit/test_properties.py
          tests/unit/test_gather.py tests/unit/test_multimap.py tests/unit/test_order.py
          tests/unit/test_speedups.py)
    echo "--- again on the pure path (APERF_NO_EXTENSIONS=1) ---"
    APERF_NO_EXTENSIONS=1 "$PYTHON" -m pytest -q -p no:cacheprovider "${selection[@]}" \
        "${PURE[@]}" || status=$?
    if [ "$all" -eq 1 ]; then
        PURE_KERNEL=(tests/kernel/test_stream.py tests/kernel/test_lease.py
                     tests/kernel/test_ringbuf.py tests/kernel/test_decode.py
                     tests/kernel/test_ordered.py)
        modes="fills or callback or overflow or losses or wrap or hands_over or backpressure"
        modes+=" or batches or arrays or leases_deliver or lease_holds or other_rings_are_read"
        modes+=" or time_order or late_rows or sync_poll_consume or both_cpus or decode"
        APERF_NO_EXTENSIONS=1 "$PYTHON" -m pytest -q -p no:cacheprovider -k "$modes" \
            "${PURE_KERNEL[@]}" || status=$?
    fi
fi
exit "$status"
