"""NatsOptions: how to reach the NATS servers, one checked, immutable value that
JetStreamSink, FleetReader, create_stream() and the commands' --nats-* options share
(issue 30 item 4). No server: everything here is decided before connecting."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from aperf._tools import nats_options
from aperf.fleet import (
    FleetConfigError,
    FleetReader,
    JetStreamSink,
    NatsOptions,
    create_stream,
)

URL = "nats://127.0.0.1:4222"


def test_it_is_checked_once_where_it_is_made() -> None:
    with pytest.raises(FleetConfigError) as info:
        NatsOptions("http://x:4222")
    assert info.value.argument == "servers"
    with pytest.raises(TypeError, match="servers must be"):
        NatsOptions([])
    with pytest.raises(ValueError, match="password needs user"):
        NatsOptions(URL, password="p")
    with pytest.raises(ValueError, match="give one of user/password, token or creds"):
        NatsOptions(URL, user="u", token="t")
    with pytest.raises(ValueError, match="connect_timeout must be positive"):
        NatsOptions(URL, connect_timeout=0)
    with pytest.raises(ValueError, match="ready_timeout must be positive"):
        NatsOptions(URL, ready_timeout=True)
    with pytest.raises(TypeError, match="connect_options must be a mapping"):
        NatsOptions(URL, connect_options=[("name", "x")])  # type: ignore[arg-type]
    with pytest.raises(FleetConfigError) as info:
        NatsOptions(URL, tls_ca="/nonexistent/ca.pem")
    assert info.value.argument == "tls_ca"


def test_it_is_a_frozen_value_that_shows_no_secret(tmp_path: Path) -> None:
    a = NatsOptions([URL, "nats://u:hunter2@10.0.0.2:4222"], user="web-1",
                    password="s3cret", connect_options={"name": "x"})
    b = NatsOptions((URL, "nats://u:hunter2@10.0.0.2:4222"), user="web-1",
                    password="s3cret", connect_options={"name": "x"})
    assert a == b and hash(a) == hash(b) and a.servers == (URL, "nats://u:hunter2@10.0.0.2:4222")
    assert a != dataclasses.replace(a, password="other")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.user = "root"  # type: ignore[misc]
    with pytest.raises(TypeError):  # a copy of the mapping, read-only
        a.connect_options["name"] = "y"  # type: ignore[index]
    shown = repr(a)
    assert "s3cret" not in shown and "hunter2" not in shown and "user='web-1'" in shown
    assert shown.startswith("NatsOptions(servers=") and "password=***" in shown
    assert "token" not in shown  # what was left as it was is not shown
    # replace() checks the copy as the constructor does.
    with pytest.raises(ValueError, match="give one of"):
        dataclasses.replace(a, token="t")
    assert dataclasses.asdict(NatsOptions(URL))["servers"] == (URL,)


def test_the_sink_the_reader_and_create_stream_take_it_or_the_keywords() -> None:
    options = NatsOptions(URL, user="web-1", password="p", ready_timeout=3.0)
    for make in (lambda o, **k: JetStreamSink(o, host="h", **k),
                 lambda o, **k: FleetReader(o, **k)):
        assert make(options)._nats is options
        # The keywords alone make the same value, as before.
        assert make(URL, user="web-1", password="p", ready_timeout=3.0)._nats == options
        # Both at once: which would win? Said, naming the keyword.
        for keyword, value in (("user", "other"), ("ready_timeout", 1.0),
                               ("connect_options", {}), ("allow_insecure", True)):
            with pytest.raises(TypeError, match=rf"^{keyword}= goes in the NatsOptions"):
                make(options, **{keyword: value})


@pytest.mark.anyio
async def test_create_stream_refuses_a_keyword_beside_it_before_connecting() -> None:
    # (No server listens on port 1: the error comes before any connection is tried.)
    options = NatsOptions("nats://127.0.0.1:1")
    with pytest.raises(TypeError, match=r"^token= goes in the NatsOptions"):
        await create_stream(options, token="t")


def test_the_commands_options_build_it(tmp_path: Path) -> None:
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    parser = argparse.ArgumentParser()
    parser.add_argument("--nats")
    nats_options.add_arguments(parser)
    args = parser.parse_args([
        "--nats", f"{URL},nats://10.0.0.2:4222", "--nats-user", "web-1",
        "--nats-password-file", str(password), "--nats-wait", "3", "--nats-insecure",
    ])
    assert nats_options.connection(args) == NatsOptions(
        [URL, "nats://10.0.0.2:4222"], user="web-1", password="s3cret",
        allow_insecure=True, connect_timeout=3.0, ready_timeout=3.0,
    )
