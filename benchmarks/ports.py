"""A free TCP port on 127.0.0.1, for the services the benchmarks start."""

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
