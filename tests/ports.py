"""A free TCP port on 127.0.0.1, for servers and torch.distributed rendezvous in tests."""

import socket


def free_port() -> int:
    """A port nothing listens on now (the OS picks it; another process may still take it before use)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
