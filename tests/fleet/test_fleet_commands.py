"""The fleet commands' one-line errors name the command-line option that fixes them (never
aperf.fleet's keyword: ``servers=``), and exit with one status for "cannot run" (1) and
another for "bad arguments" (2), the same in every command: ``python -m aperf.fleet
create-stream``, ``examples/fleet_view.py`` and ``aperf-trace --nats``. No NATS server is
needed: nothing listens on port 1 of this host. tests/fleet/test_fleet_security.py has
the credentials a server refuses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aperf._tools.nats_options import BAD_ARGUMENTS, CANNOT_RUN, failure
from aperf.fleet import (
    FleetAuthError,
    FleetConfigError,
    FleetInsecureError,
    FleetUnavailableError,
)

from ..helpers import REPO

NOWHERE = "nats://127.0.0.1:1"
COMMANDS = {
    "create-stream": ["aperf.fleet", "create-stream"],
    "fleet_view": ["examples.fleet_view"],
    "tracer": ["aperf", "trace"],  # checks its options before privileges: no root needed
}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("command", ["create-stream", "fleet_view"])
def test_no_server_cannot_run_and_names_the_option(command: str) -> None:
    result = run(*COMMANDS[command], "--nats", NOWHERE, "--nats-wait", "0.5")
    assert result.returncode == CANNOT_RUN == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert f"no NATS server answered at {NOWHERE}" in line
    assert line.endswith("(check --nats)") and "servers=" not in line, line


def test_the_tracer_without_a_server_cannot_run_either(tracefs: None) -> None:
    result = run(*COMMANDS["tracer"], "--nats", NOWHERE, "--nats-wait", "0.5")
    assert result.returncode == 1 and result.stdout == "", result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("aperf-trace: --nats: no NATS server answered")
    assert line.endswith("(check --nats)") and "servers=" not in line, line


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(
    ("options", "words"),
    [
        (["--nats-ca", "/nonexistent/ca.pem"],
         "argument --nats-ca: cannot read /nonexistent/ca.pem: No such file or directory"),
        (["--nats-creds", "/nonexistent/x.creds"], "argument --nats-creds: cannot read"),
        (["--nats-password-file", "{password}"], "--nats-password-file needs --nats-user"),
        (["--nats-key", "{password}"], "--nats-key needs --nats-cert"),
        (["--nats-user", "u", "--nats-token-file", "{password}"],
         "give one of --nats-user, --nats-token-file or --nats-creds, not --nats-user and "
         "--nats-token-file"),
    ],
    ids=["ca", "creds", "password-without-user", "key-without-cert", "user-and-token"],
)
def test_bad_options_exit_2_naming_them(
    tmp_path: Path, command: str, options: list[str], words: str
) -> None:
    password = tmp_path / "password"
    password.write_text("secret\n")
    given = [o.format(password=password) for o in options]
    result = run(*COMMANDS[command], "--nats", NOWHERE, *given)
    assert result.returncode == BAD_ARGUMENTS == 2, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr
    assert "=)" not in result.stderr and "user=" not in result.stderr


def test_failures_map_to_options_and_statuses() -> None:
    def said(exc: Exception, **kw: dict[str, str]) -> tuple[str, int]:
        return failure(exc, **kw)

    no_creds = FleetAuthError("servers", "the NATS server at nats://h:4222 refused the "
                              "credentials (Authorization Violation)")
    assert said(no_creds) == (
        "the NATS server at nats://h:4222 refused the credentials (Authorization Violation) "
        "(credentials go in --nats-user and --nats-password-file, --nats-token-file, or "
        "--nats-creds)", 2)
    assert said(FleetAuthError("password", "refused")) == (
        "refused (check --nats-user and --nats-password-file)", 2)
    assert said(FleetAuthError("tls_ca", "does not verify")) == ("does not verify (check "
                                                                 "--nats-ca)", 2)
    assert said(FleetConfigError("tls_cert", "bad pair")) == (
        "bad pair (check --nats-cert and --nats-key)", 2)
    assert said(FleetInsecureError("allow_insecure", "in clear (--nats-insecure)")) == (
        "in clear (--nats-insecure)", 2)  # the message names the option itself
    assert said(FleetInsecureError("servers", "no TLS there")) == (
        "no TLS there (check --nats)", 1)
    assert said(FleetUnavailableError("servers", "no quorum")) == ("no quorum (check --nats)", 1)
    assert said(FleetConfigError("jetstream", "no stream 'APERF'")) == (
        "no stream 'APERF' (check --jetstream)", 1)
    # A command without --jetstream (the tracer) says the message alone.
    assert said(FleetConfigError("jetstream", "no stream 'APERF'"), options={}) == (
        "no stream 'APERF'", 1)
    assert said(FleetConfigError("--nats", "bad mix")) == ("bad mix (check --nats)", 2)
    assert said(ValueError("options that do not go together")) == (
        "options that do not go together", 2)
