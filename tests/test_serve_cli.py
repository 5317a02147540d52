"""`s3serve serve` as users run it: ready message with a working curl line, clean stop on Ctrl-C."""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _is_listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_serve_prints_a_working_curl_and_stops_on_ctrl_c(tmp_path, model_cache_dir):
    port = _free_port()
    command = [str(Path(sys.executable).parent / "s3serve"), "serve", "--port", str(port), "--data-dir",
               str(tmp_path / "data"), "--model-cache-dir", str(model_cache_dir), "--max-model-len", "512",
               "--num-cpus", "4", "--api-key", "k-1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("S3_REDIS_URL", None)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    lines = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip())
            if line.startswith("Press Ctrl-C"):
                break
        output = "\n".join(lines)
        assert f"S3 Serve is ready at http://127.0.0.1:{port}" in output, output
        curl = next(line.strip() for line in lines if line.strip().startswith("curl "))
        # Run the printed example as a user would (its JSON body, URL and key).
        args = shlex.split(curl)
        url = args[1]
        body = json.loads(args[args.index("-d") + 1])
        headers = dict(h.split(": ", 1) for h in (args[i + 1] for i, a in enumerate(args) if a == "-H"))
        response = httpx.post(url, json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        assert not _is_listening(port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
