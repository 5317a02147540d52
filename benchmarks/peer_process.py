"""A peer's script in the peer's own environment: the spec in, the result out, a failure as one line."""

import json
import subprocess
import tempfile
from pathlib import Path


def wire(requests) -> list[dict]:
    """Requests as a peer script reads them (token ids, forced lengths)."""
    return [{"request_id": r.request_id, "prompt_token_ids": list(r.prompt_token_ids),
             "output_tokens": r.output_tokens} for r in requests]


def run_peer_script(name: str, python: Path, script: Path, spec: dict, env: dict[str, str], log_path: Path,
                    timeout_s: float) -> dict:
    """`python script SPEC OUT`, its output in `log_path`; the result, or ValueError naming `name`, the
    log's last line and its path."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        with log_path.open("w") as log:
            try:
                status = subprocess.run([str(python), str(script), str(spec_path), str(out_path)], stdout=log,
                                        stderr=subprocess.STDOUT, env=env, timeout=timeout_s, check=False).returncode
            except subprocess.TimeoutExpired:
                raise ValueError(f"{name} did not finish within {timeout_s:.0f} s; its log: {log_path}")
        if status != 0 or not out_path.is_file():
            lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
            raise ValueError(f"{name} exited with {status}: {(lines or ['no output'])[-1].strip()} (log: {log_path})")
        return json.loads(out_path.read_text())
