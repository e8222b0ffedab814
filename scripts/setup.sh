#!/usr/bin/env bash
# Prepare this machine for aperf (idempotent; run as root):
#   - Debian packages: clang/llvm (BPF compiler), libbpf1 + libbpf-dev, bpftool, make, gcc,
#     chromium + chromium-driver (the service page's browser test), nats-server (JetStream,
#     for the aperf.fleet tests)
#   - Python packages, in .venv: aperf itself (editable, its compiled fast path built in
#     place) with its test, service and docs extras
#   - tracefs and bpffs mounted
#   - the BPF objects built (bpf/*.bpf.o, and the shipped ones in aperf/_objects/)
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(clang llvm libbpf-dev libbpf1 bpftool make gcc chromium chromium-driver nats-server)

if [ "$(id -u)" -ne 0 ]; then
    echo "aperf setup: run as root (BPF needs it, and so do apt-get and mount)" >&2
    exit 1
fi

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "aperf setup: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# A virtual environment of the checkout's own (.venv), so that nothing else on the
# machine is changed and two checkouts do not fight over one editable install.
if [ ! -x .venv/bin/python ]; then
    echo "aperf setup: making .venv, this checkout's own Python environment" >&2
    "${BASE_PYTHON:-python3}" -m venv .venv
fi
# pip takes about 3 s even when nothing changed: skip it while what it installs from
# (pyproject.toml, this script, the interpreter) is as at the last install, so that
# scripts/tracer.sh starts at once. APERF_SETUP_FORCE=1 installs anyway.
STAMP=.venv/.aperf-setup-stamp
# The editable install compiles aperf's fast path (aperf/_native/_speedups.c) in place:
# its source is an input too.
inputs=$( { cat pyproject.toml scripts/setup.sh bpf/build_hook.py aperf/_native/_speedups.c; \
    .venv/bin/python -VV; } | sha256sum | cut -d' ' -f1)
if [ "${APERF_SETUP_FORCE:-0}" = 1 ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$inputs" ]; then
    # The distribution was called "aperf" before it became aperf-bpf: a .venv made then
    # holds that editable install too, which would shadow the metadata of the new one.
    .venv/bin/python -m pip uninstall -q -y aperf >/dev/null 2>&1 || true
    # pip says nothing with -q: say what takes the time, once, before it starts.
    echo "aperf setup: installing aperf and its Python packages into .venv with pip" \
        "(quietly: about a minute on the first run, seconds later)" >&2
    .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,service,docs]'
    echo "$inputs" > "$STAMP"
fi

if [ ! -d /sys/kernel/tracing/events ]; then
    mount -t tracefs tracefs /sys/kernel/tracing
fi
if ! mountpoint -q /sys/fs/bpf; then
    mount -t bpf bpf /sys/fs/bpf
fi

make -s -C bpf
