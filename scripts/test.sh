#!/usr/bin/env bash
# Install what is needed on a fresh machine, then run aperf's checks and tests.
# Kernel tests fail (instead of skipping) when BPF is unavailable: APERF_REQUIRE_BPF=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON=.venv/bin/python

"$PYTHON" -m ruff check aperf tests examples bench
"$PYTHON" -m mypy aperf

status=0
APERF_REQUIRE_BPF=1 "$PYTHON" -m pytest -q -p no:cacheprovider "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure" >&2
    exit 1
fi
exit "$status"
