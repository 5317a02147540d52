"""A free TCP port to listen on: the embedded Redis, the tensor-parallel rendezvous, and the services
the benchmarks and tests start.

The port is drawn from below the kernel's ephemeral range. A port the kernel hands out for `bind(0)`
comes from that range, and so does the local port of every outgoing connection: Ray alone opens
dozens between the moment a port is chosen and the moment Serve's proxy binds it, and one of them
taking the chosen number makes Serve's start fail ("Failed to bind to address"; a CI run failed
at that step). Ray's worker ports (10002-19999 by default) are avoided as well.
"""

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Above Ray's default worker ports (10002-19999); the upper end is the ephemeral range's start, less one.
LISTEN_PORT_LOW = 20000
FALLBACK_EPHEMERAL_LOW = 32768  # Linux's default when the range cannot be read
_ATTEMPTS = 200


def ephemeral_low(range_file: Path = EPHEMERAL_RANGE_FILE) -> int:
    """The first port of the kernel's ephemeral range (Linux's default where the file is absent or unreadable)."""
    try:
        return int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return FALLBACK_EPHEMERAL_LOW


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None,
              range_file: Path = EPHEMERAL_RANGE_FILE) -> int:
    """A port nothing listens on now, outside the ephemeral range when there is room below it.

    Another process may still take it before use; callers that can, retry on "address in use".
    """
    rng = rng or random.Random()
    high = ephemeral_low(range_file) - 1
    if high - LISTEN_PORT_LOW >= _ATTEMPTS:
        for port in rng.sample(range(LISTEN_PORT_LOW, high + 1), _ATTEMPTS):
            if _can_bind(host, port):
                return port
    with socket.socket() as sock:  # no room below the ephemeral range, or all of it taken: let the OS choose
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _can_bind(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
