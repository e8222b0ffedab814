#!/usr/bin/env bash
# Install what is needed on a fresh machine, then run aperf's checks and tests.
# Kernel tests fail (instead of skipping) when BPF is unavailable: APERF_REQUIRE_BPF=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON=.venv/bin/python

"$PYTHON" -m ruff check aperf tests examples bench scripts
"$PYTHON" -m mypy aperf
if ! "$PYTHON" scripts/apidoc.py --check; then
    echo "docs/api.md is out of date: run python scripts/apidoc.py" >&2
    exit 1
fi

status=0
APERF_REQUIRE_BPF=1 "$PYTHON" -m pytest -q -p no:cacheprovider "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure" >&2
    exit 1
fi
exit "$status"
