"""A small disk that can be filled to the last byte and freed again: `bench chaos`'s redis_disk_full fault.

A tmpfs of `size_mib` is mounted where the embedded Redis keeps its append-only file, before the service starts;
the fault writes a filler file until the disk is full (every further append fails with ENOSPC, and Redis refuses
writes with MISCONF), and removing the filler frees it. Mounting needs root with CAP_SYS_ADMIN: where that is
missing, `mount` raises `SmallDiskUnavailable` with the reason and the bench leaves the fault out.
"""

import errno
import subprocess
from pathlib import Path

_FILLER_NAME = ".disk-full-filler"
_CHUNK_BYTES = 1 << 20


class SmallDiskUnavailable(RuntimeError):
    """No tmpfs could be mounted here (not root, or no CAP_SYS_ADMIN in this container)."""


class SmallDisk:
    """A tmpfs mounted at `path` (created if missing) while in use.

    Args:
        path: the folder to mount over (it must be empty: what it holds is hidden while mounted).
        size_mib: the disk's size.
    """

    def __init__(self, path: Path, size_mib: int = 64) -> None:
        if size_mib < 1:
            raise ValueError(f"size_mib must be >= 1, got {size_mib}")
        self.path = Path(path)
        self.size_mib = size_mib
        self.is_mounted = False

    @property
    def filler(self) -> Path:
        return self.path / _FILLER_NAME

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        command = ["mount", "-t", "tmpfs", "-o", f"size={self.size_mib}m,mode=0700", "tmpfs", str(self.path)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise SmallDiskUnavailable(f"cannot run mount: {error}") from error
        if done.returncode != 0:
            raise SmallDiskUnavailable(f"mount -t tmpfs failed ({done.stderr.strip() or done.returncode}); "
                                       "it needs root with CAP_SYS_ADMIN")
        self.is_mounted = True

    def fill(self) -> int:
        """Write the filler until the disk is full; returns the bytes it took."""
        written = 0
        chunk = b"\0" * _CHUNK_BYTES
        with open(self.filler, "ab", buffering=0) as out:
            while True:
                try:
                    written += out.write(chunk)  # the last one short, the next one ENOSPC
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    break
        return written

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        """Unmount (after whatever wrote there has stopped); what was written goes with it."""
        if not self.is_mounted:
            return
        self.free()
        subprocess.run(["umount", str(self.path)], capture_output=True, text=True, timeout=30, check=True)
        self.is_mounted = False

    def __repr__(self) -> str:
        return f"SmallDisk({str(self.path)!r}, {self.size_mib} MiB, {'mounted' if self.is_mounted else 'unmounted'})"
