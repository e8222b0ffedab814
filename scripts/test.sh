#!/usr/bin/env bash
# Install what is needed on a fresh machine, then run aperf's checks and every test
# (as root: kernel tests fail instead of skipping when BPF is unavailable,
# APERF_REQUIRE_BPF=1). The checks are scripts/check.sh's, with nothing deselected.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
APERF_REQUIRE_BPF=1 exec bash scripts/check.sh --all "$@"
