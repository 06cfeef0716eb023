"""The rendezvous stores listen on the init method's address only (Dask's protocol and the
TCPStore have no authentication), and still serve their clients there."""

from __future__ import annotations

from datetime import timedelta

import psutil
import pytest

from stages.tcp_store import parse_init_method, tcp_store
from stages.tcp_store import free_port


def _listening() -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"}


def test_the_host_side_listens_on_the_init_methods_address_alone():
    port = free_port("127.0.0.1")
    before = _listening()
    server = tcp_store(f"tcp://127.0.0.1:{port}", 2, is_master=True, timeout=timedelta(seconds=10))
    client = tcp_store(f"tcp://127.0.0.1:{port}", 2, is_master=False, timeout=timedelta(seconds=10))
    server.set("k", "v")
    assert client.get("k") == b"v"
    assert _listening() - before == {("127.0.0.1", port)}  # torch's own default would be ("::", port)
    del client, server
    assert ("127.0.0.1", port) not in _listening()


def test_a_taken_port_fails_at_once():
    port = free_port("127.0.0.1")
    first = tcp_store(f"tcp://127.0.0.1:{port}", 1, is_master=True, timeout=timedelta(seconds=10))
    with pytest.raises(OSError):
        tcp_store(f"tcp://127.0.0.1:{port}", 1, is_master=True, timeout=timedelta(seconds=10))
    del first


@pytest.mark.parametrize("bad", ["127.0.0.1:80", "http://127.0.0.1:80", "tcp://127.0.0.1"])
def test_an_init_method_without_tcp_host_and_port_is_refused(bad):
    with pytest.raises(ValueError, match="tcp://host:port"):
        parse_init_method(bad)
