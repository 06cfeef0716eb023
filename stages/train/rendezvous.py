"""Where the training ranks' process group meets: a free TCP port on rank 0's host."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now. Run it on the host that will listen (rank 0's worker);
    another process may take the port before the rendezvous binds it, a window of milliseconds."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
