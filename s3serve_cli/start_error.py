"""The error `s3serve serve` raises when start-up gives up (apart, so the benches need none of the service's imports)."""


class ServiceStartError(RuntimeError):
    """Start-up gave up; the message says at which step and why, on one line."""
