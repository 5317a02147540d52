"""llama.cpp and OpenVINO GenAI in `bench peers`: their model files, environments and one run each.

Both get what vLLM and our engine get: the same SmolLM2-135M-Instruct weights, the
same requests as token ids, forced lengths, greedy, and the same KV tokens.

- llama.cpp (`benchmarks/llamacpp_peer.py`): `llama-server` from the peer virtual
  environment, at bf16 (a GGUF of our weights, `benchmarks/gguf_bf16.py`) and, as a
  second row at its users' default precision, the shipped Q4_1 GGUF.
- OpenVINO GenAI (`benchmarks/openvino_peer.py`): its own virtual environment
  (`.venv-openvino`), the model exported once to OpenVINO IR with fp16 weights
  (`optimum-cli export openvino`), computed and cached in bf16 where the CPU has it.
"""

import os
import subprocess
from pathlib import Path

from benchmarks.gguf_bf16 import bf16_gguf_path, write_bf16_gguf
from benchmarks.llamacpp_peer import find_server, run_llamacpp, slot_plan
from benchmarks.peer_process import run_peer_script, wire
from workers.actors.ports import free_port
from workers.engine.models import find_default_gguf
from workers.engine.runtime import usable_cores

OPENVINO_SCRIPT = Path(__file__).with_name("openvino_peer.py")
OPENVINO_WARMUP = {"requests": 16, "output_tokens": 8}


def llamacpp_gguf(precision: str, cache_dir: Path) -> Path:
    """The GGUF llama.cpp runs: "q4_1" is the shipped file, "bf16" its matrices at bf16 (written once)."""
    shipped = find_default_gguf()
    if precision == "q4_1":
        return shipped
    return write_bf16_gguf(shipped, bf16_gguf_path(shipped, cache_dir))


def run_llamacpp_peer(venv: Path, gguf: Path, requests, kv_tokens: int, log_path: Path, timeout_s: float,
                      single=None) -> dict:
    """One llama-server run: the slots `kv_tokens` holds for the workload's longest request."""
    longest = max(len(r.prompt_token_ids) + r.output_tokens for r in requests)
    if single is not None:
        longest = max(longest, len(single.prompt_token_ids) + single.output_tokens)
    plan = slot_plan(kv_tokens, longest)
    return run_llamacpp(find_server(venv), gguf, wire(requests), plan, usable_cores(), free_port(), log_path,
                        timeout_s, wire([single])[0] if single is not None else None)


def openvino_python(venv: Path) -> Path:
    """The OpenVINO environment's interpreter; ValueError naming `make peers` when it is missing."""
    python = venv / "bin" / "python"
    if not (python.is_file() and (venv / ".installed").is_file()):
        raise ValueError(f"the OpenVINO peer environment {venv}/ is missing or incomplete; create it with "
                         "`make peers`, or leave openvino out of --systems")
    return python


def openvino_environment(venv: Path) -> dict[str, str]:
    scratch = (venv / "scratch").resolve()
    (scratch / "tmp").mkdir(parents=True, exist_ok=True)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(scratch / "hf"),
            "TMPDIR": str(scratch / "tmp")}


def export_openvino(venv: Path, model_dir: Path, cache_dir: Path, log_path: Path) -> Path:
    """The model in OpenVINO IR (fp16 weights), exported once into `cache_dir` by the environment's optimum-cli."""
    out_dir = cache_dir / f"{model_dir.name}-openvino-fp16"
    if (out_dir / "openvino_model.xml").is_file():
        return out_dir
    openvino_python(venv)
    partial = out_dir.with_name(out_dir.name + ".partial")
    print(f"exporting {model_dir.name} to OpenVINO IR (once; about a minute) into {out_dir}")
    with log_path.open("w") as log:
        status = subprocess.run([str(venv / "bin" / "optimum-cli"), "export", "openvino", "--model", str(model_dir),
                                 "--task", "text-generation-with-past", "--weight-format", "fp16", str(partial)],
                                stdout=log, stderr=subprocess.STDOUT, env=openvino_environment(venv),
                                check=False).returncode
    if status != 0 or not (partial / "openvino_model.xml").is_file():
        raise ValueError(f"optimum-cli could not export {model_dir} to OpenVINO IR (exit {status}; log: {log_path})")
    partial.replace(out_dir)
    return out_dir


def openvino_spec(model_dir: Path, requests, kv_tokens: int, precision: str, max_num_seqs: int,
                  max_num_batched_tokens: int, single=None) -> dict:
    """What `openvino_peer.py` runs: the same step limits as our engine's."""
    return {"model_dir": str(model_dir), "kv_tokens": kv_tokens, "precision": precision, "threads": usable_cores(),
            "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
            "requests": wire(requests), "warmup": OPENVINO_WARMUP,
            "single": wire([single])[0] if single is not None else None}


def run_openvino_peer(venv: Path, spec: dict, log_path: Path, timeout_s: float) -> dict:
    """One OpenVINO process; ValueError (with the log's path) when it fails."""
    return run_peer_script("OpenVINO", openvino_python(venv), OPENVINO_SCRIPT, spec, openvino_environment(venv),
                           log_path, timeout_s)
