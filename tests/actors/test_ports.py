"""workers.actors.ports: listening ports come from below the ephemeral range, and never one already taken."""

import random
import socket

from workers.actors.ports import FALLBACK_EPHEMERAL_LOW, LISTEN_PORT_LOW, ephemeral_low, free_port


def _range_file(tmp_path, text):
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    return path


def test_the_port_lies_between_rays_worker_ports_and_the_ephemeral_range_and_can_be_bound(tmp_path):
    range_file = _range_file(tmp_path, "32768\t60999\n")
    for seed in range(20):
        port = free_port(rng=random.Random(seed), range_file=range_file)
        assert LISTEN_PORT_LOW <= port < 32768
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_something_listens_on_is_passed_over(tmp_path):
    range_file = _range_file(tmp_path, "20201 60999")  # 201 candidates, so the draw covers nearly all
    first = free_port(rng=random.Random(7), range_file=range_file)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", first))
        holder.listen()
        second = free_port(rng=random.Random(7), range_file=range_file)  # the same draw, its first port taken
    assert second != first
    assert LISTEN_PORT_LOW <= second <= 20200


def test_the_kernels_range_is_read_and_a_missing_or_garbled_file_means_linuxs_default(tmp_path):
    assert ephemeral_low(_range_file(tmp_path, "40000 50000")) == 40000
    assert ephemeral_low(tmp_path / "absent") == FALLBACK_EPHEMERAL_LOW
    assert ephemeral_low(_range_file(tmp_path, "garbled")) == FALLBACK_EPHEMERAL_LOW


def test_without_room_below_the_ephemeral_range_the_os_chooses(tmp_path):
    range_file = _range_file(tmp_path, "20050 60999")  # fewer candidates than draws
    port = free_port(range_file=range_file)
    assert not LISTEN_PORT_LOW <= port < 20050
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
