"""The error the service's start raises when it gives up (apart, so the CLI and benches need none of its imports)."""


class ServiceStartError(RuntimeError):
    """Start-up gave up; the message says at which step and why, on one line."""
