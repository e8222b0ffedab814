#!/usr/bin/env bash
# Install what is needed on a fresh machine, then start the exec/exit tracer.
# Arguments go to the tracer (e.g. -d 50, --json); Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m examples.bootstrap_legacy "$@"
