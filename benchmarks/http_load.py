"""HTTP load generator of `bench cluster`: replays a request file against the service, in its own process.

    python -m benchmarks.http_load --plan plan.json --out results.json

The load runs in a process of its own so that the client's event loop and JSON
parsing never share an interpreter (or a GIL) with Ray's driver in the bench.
Each request is sent at its arrival time (seconds after the start) through one
`httpx.AsyncClient`, at most `concurrency` at once, streamed (`stream: true`,
`stream_options.include_usage`) so time to first token is measured here, at the
client. A request the service refuses (429, 503, ...) is recorded as failed,
never retried: the bench reports it.

Plan file (JSON):

    {"base_url": "http://127.0.0.1:PORT", "model": "...", "concurrency": 64,
     "requests": [{"request_id", "arrival_s", "prompt", "num_prompt_tokens",
                   "max_tokens", "forced_output_tokens"}, ...]}

Results file (JSON): {"results": [RequestResult as a dict, ...]}, times in seconds
since the load's start (a monotonic clock of this process).
"""

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

OVERHEAD_HEADER = "x-s3-overhead-ms"  # cluster.ingress.router.OVERHEAD_HEADER; not imported: this process stays light
MAX_ERROR_CHARS = 300


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """One completion request of the plan.

    Attributes:
        request_id: the trace row's id (the service assigns its own id too).
        arrival_s: when to send it, seconds after the load starts.
        prompt: the prompt text.
        num_prompt_tokens: the prompt's length in the served model's tokens.
        max_tokens: the request's limit (what max_reserve reserves).
        forced_output_tokens: the service's benchmark extension: finish after exactly this many.
        priority: the request's class (lower is more urgent).
    """

    request_id: str
    arrival_s: float
    prompt: str
    num_prompt_tokens: int
    max_tokens: int
    forced_output_tokens: int
    priority: int = 0


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What to send where.

    Attributes:
        base_url: the service, e.g. http://127.0.0.1:8000.
        model: the model id clients send.
        concurrency: most requests in flight at once.
        requests: in arrival order.
    """

    base_url: str
    model: str
    concurrency: int
    requests: tuple[LoadRequest, ...]


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What the client saw of one request; times in seconds since the load started.

    Attributes:
        request_id: the plan's id.
        is_ok: a 200 whose stream ended with a usage chunk.
        status_code: HTTP status (None when the connection failed).
        error: why it failed, else None.
        sent_s: when it was sent (after waiting for its arrival time and a concurrency slot).
        first_token_s: when the first text chunk arrived.
        finished_s: when the stream ended (or the failure was seen).
        num_completion_tokens: `usage.completion_tokens` of the last chunk.
        num_prompt_tokens: `usage.prompt_tokens` of the last chunk.
        overhead_ms: the service's router + predictor + placement time (its response header).
    """

    request_id: str
    is_ok: bool
    status_code: int | None
    error: str | None
    sent_s: float
    first_token_s: float | None
    finished_s: float
    num_completion_tokens: int | None
    num_prompt_tokens: int | None
    overhead_ms: float | None


def write_plan(path: Path | str, plan: LoadPlan) -> None:
    body = {"base_url": plan.base_url, "model": plan.model, "concurrency": plan.concurrency,
            "requests": [asdict(r) for r in plan.requests]}
    Path(path).write_text(json.dumps(body))


def read_plan(path: Path | str) -> LoadPlan:
    """The plan file; ValueError naming the file when it is not one."""
    path = Path(path)
    try:
        body = json.loads(path.read_text())
        requests = tuple(LoadRequest(**r) for r in body["requests"])
        plan = LoadPlan(str(body["base_url"]), str(body["model"]), int(body["concurrency"]), requests)
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a load plan ({type(error).__name__}: {error})") from None
    if plan.concurrency < 1:
        raise ValueError(f"{path}: concurrency must be >= 1, got {plan.concurrency}")
    return plan


def read_results(path: Path | str) -> list[RequestResult]:
    return [RequestResult(**r) for r in json.loads(Path(path).read_text())["results"]]


def request_body(plan: LoadPlan, request: LoadRequest) -> dict:
    """The completions body: streamed with usage, greedy, length fixed by the forced-length extension."""
    return {"model": plan.model, "prompt": request.prompt, "max_tokens": request.max_tokens,
            "forced_output_tokens": request.forced_output_tokens, "ignore_eos": True, "temperature": 0.0,
            "priority": request.priority,
            "stream": True, "stream_options": {"include_usage": True}}


async def _send(http: httpx.AsyncClient, plan: LoadPlan, request: LoadRequest, start_s: float) -> RequestResult:
    sent_s = time.monotonic() - start_s
    first_token_s = None
    usage = None
    status_code = None
    overhead_ms = None
    error = None
    try:
        async with http.stream("POST", f"{plan.base_url}/v1/completions", json=request_body(plan, request)) as response:
            status_code = response.status_code
            header = response.headers.get(OVERHEAD_HEADER)
            overhead_ms = float(header) if header is not None else None
            if status_code != 200:
                error = (await response.aread()).decode(errors="replace")[:MAX_ERROR_CHARS]
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = json.dumps(chunk["error"])[:MAX_ERROR_CHARS]
                        break
                    if first_token_s is None and any(c.get("text") for c in chunk.get("choices") or ()):
                        first_token_s = time.monotonic() - start_s
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                if error is None and usage is None:
                    error = "the stream ended without a usage chunk"
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as failure:
        error = f"{type(failure).__name__}: {failure}"[:MAX_ERROR_CHARS]
    return RequestResult(
        request_id=request.request_id, is_ok=error is None, status_code=status_code, error=error, sent_s=sent_s,
        first_token_s=first_token_s, finished_s=time.monotonic() - start_s,
        num_completion_tokens=usage.get("completion_tokens") if usage else None,
        num_prompt_tokens=usage.get("prompt_tokens") if usage else None, overhead_ms=overhead_ms)


async def drive(plan: LoadPlan, progress: tqdm | None = None) -> list[RequestResult]:
    """Send every request of the plan at its arrival time, at most `concurrency` at once; results in plan order."""
    slots = asyncio.Semaphore(plan.concurrency)
    limits = httpx.Limits(max_connections=plan.concurrency, max_keepalive_connections=plan.concurrency)
    # No read timeout: under max_reserve a request may wait minutes for KV room before its first byte.
    timeout = httpx.Timeout(None, connect=30.0)
    start_s = time.monotonic()

    async def one(http: httpx.AsyncClient, request: LoadRequest) -> RequestResult:
        await asyncio.sleep(max(0.0, start_s + request.arrival_s - time.monotonic()))
        async with slots:
            result = await _send(http, plan, request, start_s)
        if progress is not None:
            progress.update(1)
            if not result.is_ok:
                progress.set_postfix_str(f"failed: {result.status_code}")
        return result

    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as http:
        return list(await asyncio.gather(*(one(http, r) for r in plan.requests)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.http_load",
        description="Send a load plan's completion requests to an S3 Serve service at their arrival times "
                    "(streamed, bounded concurrency) and write what each one saw.")
    parser.add_argument("--plan", type=Path, required=True, help="load plan JSON written by `bench cluster`")
    parser.add_argument("--out", type=Path, required=True, help="results JSON to write")
    parser.add_argument("--desc", default="requests", help="progress bar label")
    args = parser.parse_args(argv)
    try:
        plan = read_plan(args.plan)
    except ValueError as error:
        print(f"http_load: error: {error}", file=sys.stderr)
        return 2
    with tqdm(total=len(plan.requests), desc=args.desc, unit="req") as progress:
        results = asyncio.run(drive(plan, progress))
    args.out.write_text(json.dumps({"results": [asdict(r) for r in results]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
