"""`bench chaos`'s full disk: a tmpfs filled to its last byte and freed, and the embedded Redis on it refusing writes
with MISCONF while it is full and taking them again once it is not."""

import time

import pytest
import redis

from benchmarks.small_disk import SmallDisk, SmallDiskUnavailable
from cluster.control.redis_server import EmbeddedRedis, connect


@pytest.fixture
def disk(tmp_path):
    disk = SmallDisk(tmp_path / "disk", size_mib=2)
    try:
        disk.mount()
    except SmallDiskUnavailable as error:
        assert "CAP_SYS_ADMIN" in str(error)  # the reason the bench prints when it leaves the fault out
        pytest.skip(f"no tmpfs can be mounted here: {error}")
    yield disk
    disk.unmount()
    assert not disk.is_mounted and not (tmp_path / "disk" / "anything").exists()


def test_a_full_disk_takes_no_byte_more_until_it_is_freed(disk):
    (disk.path / "anything").write_bytes(b"x" * 4096)
    assert disk.fill() == 2 * 2**20 - 4096
    with pytest.raises(OSError, match="No space left on device"):
        (disk.path / "more").write_bytes(b"x" * 4096)
    disk.free()
    (disk.path / "more").write_bytes(b"x" * 4096)


def test_redis_on_a_full_disk_refuses_writes_then_takes_them_again(disk):
    with EmbeddedRedis(disk.path / "redis") as server:
        client = connect(server.url)
        client.set("before", "1")
        disk.fill()
        deadline_s, refused = time.monotonic() + 5.0, None
        while refused is None and time.monotonic() < deadline_s:
            try:
                client.set("during", "x" * 4096)  # the first may land in the last bytes; the append fails
            except redis.ResponseError as error:
                refused = error
        assert refused is not None and "MISCONF" in str(refused)
        assert client.get("before") == "1"  # reads go on
        disk.free()
        deadline_s = time.monotonic() + 5.0
        while True:  # Redis retries the append every second and takes writes once it succeeds
            try:
                client.set("after", "1")
                break
            except redis.ResponseError:
                assert time.monotonic() < deadline_s, "Redis still refuses writes 5 s after the disk was freed"
                time.sleep(0.1)
        assert client.get("after") == "1"


def test_bad_sizes_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="size_mib must be >= 1"):
        SmallDisk(tmp_path, size_mib=0)
