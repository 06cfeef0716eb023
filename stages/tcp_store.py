"""A torch.distributed TCPStore whose server listens on one address only.

``dist.TCPStore(host, port, is_master=True)`` binds its server to every interface (``::``) whatever
``host`` says, and its protocol has no authentication: anyone who reaches the port can read and
write the rendezvous keys. The host side here binds a socket to exactly the ``tcp://host:port`` of
the init method (the address the other ranks dial: loopback on one machine, rank 0's worker address
across hosts) and hands it to the store (``master_listen_fd``), which then owns it.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

__all__ = ["free_port", "parse_init_method", "tcp_store"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a store's ``init_method``. Run it on the host that will
    listen (rank 0's worker); another process may take the port before the store binds it, a window
    of milliseconds."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_init_method(init_method: str) -> tuple[str, int]:
    """(host, port) of ``tcp://host:port``; a ValueError naming the value otherwise."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"init_method={init_method!r} must look like tcp://host:port")
    return url.hostname, url.port


def _listening_fd(host: str, port: int) -> int:
    """A socket bound to (host, port) and listening, detached: the caller owns the descriptor."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def tcp_store(init_method: str, world_size: int, is_master: bool, timeout: timedelta) -> dist.TCPStore:
    """The store at ``init_method``: its server (``is_master``) listening on that address alone, or
    a client of it."""
    host, port = parse_init_method(init_method)
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout, wait_for_workers=False)
    fd = _listening_fd(host, port)
    try:
        # The store owns (and closes) the descriptor it is given: hand it a duplicate and close our
        # own, so no path closes a number that another thread may have reused.
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=os.dup(fd))
    finally:
        os.close(fd)
