#!/usr/bin/env bash
# The fast check, as any user: lint, types, the docs site, and the tests that need
# no BPF. No root, no apt, no mount, no make. The tests are selected with
#   pytest -m "not kernel and not packaging"
# where "kernel" is set on every test that takes the kernel fixture (tests/conftest.py)
# and "packaging" marks the wheel build tests. scripts/test.sh is the full run (root):
# it runs this script with --all, which deselects nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
selection=(-m "not kernel and not packaging")
if [ "${1:-}" = "--all" ]; then
    shift
    selection=()
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

status=0
"$PYTHON" -m pytest -q -p no:cacheprovider "${selection[@]}" "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure" >&2
    exit 1
fi
exit "$status"
