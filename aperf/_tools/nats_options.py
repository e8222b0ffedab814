"""The ``--nats-*`` options every aperf command that talks to NATS takes (``aperf-trace
--nats``, ``python -m aperf.fleet create-stream``, ``examples/fleet_view.py``).

Here, not in aperf.fleet, so that ``aperf-trace --help`` works without nats-py.
Secrets come from files, never from the command line, where every user of the
machine can read them (``/proc/<pid>/cmdline``).
"""

from __future__ import annotations

import argparse
import logging
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..fleet import NatsOptions

DEFAULT_WAIT = 10.0  # seconds: a cluster elects a leader within a few
CANNOT_RUN = 1
"""Exit status of every command when it cannot run as things are: no server answers, no
JetStream, no stream, no quorum, TLS the server does not offer."""
BAD_ARGUMENTS = 2
"""Exit status of every command when its command line is wrong (argparse's too): an option
malformed or unreadable, options that do not go together, or credentials or permissions
the NATS server refused."""

# aperf.fleet's argument names (FleetConfigError.argument) and the options that set them.
OPTIONS = {
    "servers": "--nats",
    "jetstream": "--jetstream",
    "host": "--host",
    "user": "--nats-user and --nats-password-file",
    "password": "--nats-user and --nats-password-file",
    "token": "--nats-token-file",
    "creds": "--nats-creds",
    "tls_ca": "--nats-ca",
    "tls_cert": "--nats-cert and --nats-key",
    "tls_key": "--nats-key",
    "signing_key": "--nats-signing-key",
    "host_keys": "--nats-host-keys",
}  # allow_insecure: aperf.fleet's message names --nats-insecure itself
CREDENTIALS = "--nats-user and --nats-password-file, --nats-token-file, or --nats-creds"
# A FleetConfigError naming one of these is about what the command line gave: status 2.
GIVEN = frozenset({"host", "user", "password", "token", "creds", "tls_ca", "tls_cert",
                   "tls_key", "allow_insecure", "signing_key", "host_keys"})


def secret_file(path: str) -> str:
    """An option's value read from the file ``path`` (the first line, without its end)."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.readline().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from None
    if not text:
        raise argparse.ArgumentTypeError(f"{path} is empty")
    return text


def readable_file(path: str) -> str:
    """A file option (``--nats-creds``, ``--nats-ca``, ...) that this process can read."""
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror}") from None
    return path


def nats_urls(text: str) -> str:
    """``--nats URL[,URL...]``, each URL checked as the sink and the reader will (without
    nats-py, as given: the command then says what to install)."""
    try:
        from ..fleet._args import url_problem
    except ImportError:
        return text
    for url in servers(text):
        problem = url_problem(url)
        if problem:
            shown = url if len(url) <= 80 else url[:80] + "..."
            raise argparse.ArgumentTypeError(f"{shown!r} is not a NATS URL: {problem}")
    return text


def failure(exc: Exception, *, options: dict[str, str] = OPTIONS) -> tuple[str, int]:
    """What a command says, in one line, of an error of aperf.fleet (or of a ValueError or
    TypeError: options that do not go together), and its exit status.

    The line names the command-line option that fixes it (``options``: the command's own,
    by aperf.fleet's argument name), not aperf.fleet's keyword; the status is
    ``BAD_ARGUMENTS`` for what the command line gave (the server refused the credentials,
    or the options name a file that does not serve), ``CANNOT_RUN`` for the rest.
    """
    argument = getattr(exc, "argument", None)
    if not isinstance(argument, str):
        return str(exc), BAD_ARGUMENTS
    text = str(exc).removesuffix(f" (check {argument}=)")
    from ..fleet import FleetAuthError

    refused = isinstance(exc, FleetAuthError)
    if refused and argument == "servers":  # none given, or user:password@ in the URL
        return f"{text} (credentials go in {CREDENTIALS})", BAD_ARGUMENTS
    given = argument.startswith("--")  # a command's own: FleetConfigError("--nats", ...)
    option = argument if given else options.get(argument)
    status = BAD_ARGUMENTS if refused or given or argument in GIVEN else CANNOT_RUN
    return (f"{text} (check {option})" if option else text), status


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the credentials, TLS and waiting options of a NATS connection."""
    group = parser.add_argument_group(
        "NATS connection (a URL may also hold user:password@; docs/fleet.md: Security)"
    )
    group.add_argument("--nats-user", metavar="NAME", help="the NATS user")
    group.add_argument(
        "--nats-password-file", type=secret_file, metavar="PATH", dest="nats_password",
        help="a file holding the user's password (its first line)",
    )
    group.add_argument(
        "--nats-token-file", type=secret_file, metavar="PATH", dest="nats_token",
        help="a file holding the server's authorization token",
    )
    group.add_argument(
        "--nats-creds", type=readable_file, metavar="PATH",
        help="a NATS credentials file (user JWT and nkey seed)",
    )
    group.add_argument(
        "--nats-ca", type=readable_file, metavar="PATH",
        help="TLS: the CA certificate that signed the server's certificate (a tls:// URL "
        "without it trusts the system's CAs); given, TLS is required",
    )
    group.add_argument(
        "--nats-cert", type=readable_file, metavar="PATH",
        help="TLS: a client certificate (servers that verify)",
    )
    group.add_argument("--nats-key", type=readable_file, metavar="PATH",
                       help="TLS: the client certificate's key")
    group.add_argument(
        "--nats-tls-first", action="store_true",
        help="TLS: start TLS before the server's INFO (a server with handshake_first)",
    )
    group.add_argument(
        "--nats-insecure", action="store_true",
        help="allow the password or token in clear (no TLS) to a server not on this host",
    )
    group.add_argument(
        "--nats-wait", type=positive_seconds, default=DEFAULT_WAIT, metavar="SECONDS",
        help="how long to wait at start for a NATS server, then for JetStream to serve "
        f"(a cluster electing a leader), each (default {DEFAULT_WAIT:g})",
    )


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Options that do not go together, said by their names (status 2, as argparse does)."""
    given = [name for name, value in (("--nats-user", args.nats_user),
                                      ("--nats-token-file", args.nats_token),
                                      ("--nats-creds", args.nats_creds)) if value is not None]
    if len(given) > 1:
        parser.error(f"give one of --nats-user, --nats-token-file or --nats-creds, not "
                     f"{' and '.join(given)}")
    if args.nats_password is not None and args.nats_user is None:
        parser.error("--nats-password-file needs --nats-user")
    if args.nats_key is not None and args.nats_cert is None:
        parser.error("--nats-key needs --nats-cert")


def servers(text: str) -> list[str]:
    """``--nats URL[,URL...]``: the URLs (a cluster's nodes, any of which will do)."""
    return [url.strip() for url in text.split(",") if url.strip()] or [text]


def connection(args: argparse.Namespace) -> NatsOptions:
    """The ``--nats`` URLs and the ``--nats-*`` options as the one value JetStreamSink,
    FleetReader and create_stream take (checked there: errors name aperf.fleet's
    argument, which ``failure()`` turns into the option). Needs nats-py."""
    from ..fleet import NatsOptions

    return NatsOptions(
        servers(args.nats), user=args.nats_user, password=args.nats_password,
        token=args.nats_token, creds=args.nats_creds, tls_ca=args.nats_ca,
        tls_cert=args.nats_cert, tls_key=args.nats_key, tls_handshake_first=args.nats_tls_first,
        allow_insecure=args.nats_insecure, connect_timeout=args.nats_wait,
        ready_timeout=args.nats_wait,
    )


class _TlsEofNoise(logging.Filter):
    """asyncio warns when nats-py's protocol returns True from ``eof_received`` under
    TLS, which it does whenever the server closes a connection (as after refusing
    credentials): a second, meaningless line under the command's own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received()" not in record.getMessage()


def quiet_tls_eof() -> None:
    """For the commands (never the library): drop that one asyncio warning."""
    logging.getLogger("asyncio").addFilter(_TlsEofNoise())


def one_line_warnings(prog: str) -> None:
    """For the commands (never the library): aperf's warnings (a password sent in clear
    to this host) as one line, ``PROG: warning: ...``, without a file and source line."""
    shown = warnings.formatwarning

    def formatted(
        message: Warning | str, category: type[Warning], filename: str, lineno: int,
        line: str | None = None,
    ) -> str:
        if category.__module__.startswith("aperf."):
            return f"{prog}: warning: {message}\n"
        return shown(message, category, filename, lineno, line)

    warnings.formatwarning = formatted
