"""The errors aperf.fleet raises on purpose."""

from __future__ import annotations

from .. import AperfError


class FleetError(AperfError):
    """Base class of aperf.fleet's errors."""


class FleetConfigError(FleetError, ValueError):
    """The fleet cannot start as configured: no server answers, the server refused the
    credentials, JetStream is off, or the JetStream stream is missing or takes other subjects.

    ``argument`` names the argument to fix (``"servers"``, ``"jetstream"``, ...).
    """

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{message} (check {argument}=)")
        self.argument = argument


class FleetAuthError(FleetConfigError):
    """The NATS server refused who the client is or what it asked to do: a wrong user,
    password, token or credentials file, a TLS certificate that does not verify, or a
    permission the user lacks (a host publishing as another host, a reader without the
    JetStream API subjects it needs). No retry cures it.
    """


class FleetInsecureError(FleetConfigError):
    """The connection would not protect what it carries, so aperf did not make it: TLS
    was asked for (a ``tls://`` URL, ``tls_ca``/``tls_cert``, ``tls_handshake_first``)
    and the server offers none (``argument`` ``"servers"``), or a password or token
    would cross the network in clear to a server that is not on this host
    (``"allow_insecure"``). Nothing secret was sent; no retry cures it.
    """


class FleetInsecureWarning(UserWarning):
    """A password or token went in clear to a NATS server on this host (loopback):
    no one on the network sees it, but a local user who holds the port first does.
    Said once per server; ``allow_insecure=True`` (``--nats-insecure``) silences it."""


class FleetUnavailableError(FleetConfigError):
    """JetStream is enabled but did not serve the request within ``ready_timeout``
    seconds: a cluster without a quorum or electing a leader. The message says what
    the server answered (or that it did not answer).
    """


class FleetClosedError(FleetError):
    """The sink or reader was closed, or its NATS connection closed for good."""


class FrameError(FleetError, ValueError):
    """A message is not an aperf.fleet frame (wrong magic, version, or truncated)."""
