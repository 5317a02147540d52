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
     "endpoint": "completions" | "chat",        (optional; chat sends the prompt as one user message)
     "requests": [{"request_id", "arrival_s", "prompt", "num_prompt_tokens",
                   "max_tokens", "forced_output_tokens", "priority", "messages"}, ...]}

A request whose `forced_output_tokens` is null runs to the model's own stop (EOS or
max_tokens); `messages`, when set, are sent as they are to the chat endpoint.

Results file (JSON): {"start_unix_s": ..., "results": [RequestResult as a dict, ...]}, times
in seconds since the load's start (a monotonic clock of this process; `start_unix_s` is
that start on the wall clock, for lining results up with events outside this process).
"""

import argparse
import asyncio
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

# cluster.ingress.completions.OVERHEAD_HEADER; not imported: this process stays light
OVERHEAD_HEADER = "x-s3-overhead-ms"
MAX_ERROR_CHARS = 300
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
CANCELLED = "cancelled by the client"  # a RequestResult's error when the plan said to hang up


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """One completion request of the plan.

    Attributes:
        request_id: the trace row's id (the service assigns its own id too).
        arrival_s: when to send it, seconds after the load starts.
        prompt: the prompt text.
        num_prompt_tokens: the prompt's length in the served model's tokens.
        max_tokens: the request's limit (what max_reserve reserves).
        forced_output_tokens: the service's benchmark extension: finish after exactly this many; None lets
            the model stop on its own (EOS or max_tokens), greedy.
        priority: the request's class (lower is more urgent).
        messages: the chat messages to send (chat endpoint); None sends `prompt` as one user message.
        stream: False asks for the whole answer in one JSON body.
        cancel_after_events: a streamed request's client hangs up after this many text events (None: never).
    """

    request_id: str
    arrival_s: float
    prompt: str
    num_prompt_tokens: int
    max_tokens: int
    forced_output_tokens: int | None
    priority: int = 0
    messages: tuple[dict, ...] | None = None
    stream: bool = True
    cancel_after_events: int | None = None


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What to send where.

    Attributes:
        base_url: the service, e.g. http://127.0.0.1:8000.
        model: the model id clients send.
        concurrency: most requests in flight at once.
        requests: in arrival order.
        endpoint: "completions" or "chat" (/v1/chat/completions, the prompt as one user message).
    """

    base_url: str
    model: str
    concurrency: int
    requests: tuple[LoadRequest, ...]
    endpoint: str = "completions"


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
        retry_after_s: a refusal's `Retry-After` header, when it had one.
        num_text_events: stream events that carried text (each carries at least one token).
        saw_done: the stream ended with `data: [DONE]`.
        output_digest: a fingerprint of the streamed text (`text_digest`), so runs can be compared
            answer by answer; None when the request failed.
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
    retry_after_s: float | None = None
    num_text_events: int = 0
    saw_done: bool = False
    output_digest: str | None = None


def write_plan(path: Path | str, plan: LoadPlan) -> None:
    body = {"base_url": plan.base_url, "model": plan.model, "concurrency": plan.concurrency,
            "endpoint": plan.endpoint, "requests": [asdict(r) for r in plan.requests]}
    Path(path).write_text(json.dumps(body))


def read_plan(path: Path | str) -> LoadPlan:
    """The plan file; ValueError naming the file when it is not one."""
    path = Path(path)
    try:
        body = json.loads(path.read_text())
        requests = tuple(LoadRequest(**(r | {"messages": tuple(r["messages"]) if r.get("messages") else None}))
                         for r in body["requests"])
        plan = LoadPlan(str(body["base_url"]), str(body["model"]), int(body["concurrency"]), requests,
                        str(body.get("endpoint", "completions")))
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a load plan ({type(error).__name__}: {error})") from None
    if plan.concurrency < 1:
        raise ValueError(f"{path}: concurrency must be >= 1, got {plan.concurrency}")
    if plan.endpoint not in ENDPOINTS:
        raise ValueError(f"{path}: endpoint must be one of {sorted(ENDPOINTS)}, got {plan.endpoint!r}")
    return plan


def read_results(path: Path | str) -> list[RequestResult]:
    return [RequestResult(**r) for r in json.loads(Path(path).read_text())["results"]]


def read_start_unix_s(path: Path | str) -> float | None:
    """When the load started, on the wall clock (None in results written before it was recorded)."""
    return json.loads(Path(path).read_text()).get("start_unix_s")


def request_body(plan: LoadPlan, request: LoadRequest) -> dict:
    """The request body: streamed with usage (unless the request says not), greedy; the length fixed by the
    forced-length extension when set."""
    body = {"model": plan.model, "max_tokens": request.max_tokens, "temperature": 0.0, "priority": request.priority,
            **({"stream": True, "stream_options": {"include_usage": True}} if request.stream else {})}
    if request.forced_output_tokens is not None:
        body |= {"forced_output_tokens": request.forced_output_tokens, "ignore_eos": True}
    if plan.endpoint == "chat":
        body["messages"] = list(request.messages or ({"role": "user", "content": request.prompt},))
    else:
        body["prompt"] = request.prompt
    return body


def _choices_text(body: dict, part: str) -> str:
    """The text of a stream chunk's (`part` "delta") or a whole answer's (`part` "message") choices."""
    return "".join(c.get("text") or (c.get(part) or {}).get("content") or "" for c in body.get("choices") or ())


def text_digest(text: str) -> str:
    """A short fingerprint of one answer's text."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


async def _send(http: httpx.AsyncClient, plan: LoadPlan, request: LoadRequest, start_s: float) -> RequestResult:
    sent_s = time.monotonic() - start_s
    first_token_s = None
    usage = None
    status_code = None
    overhead_ms = None
    error = None
    retry_after_s = None
    num_text_events = 0
    saw_done = False
    pieces = []
    url = f"{plan.base_url}{ENDPOINTS[plan.endpoint]}"
    try:
        async with http.stream("POST", url, json=request_body(plan, request)) as response:
            status_code = response.status_code
            header = response.headers.get(OVERHEAD_HEADER)
            overhead_ms = float(header) if header is not None else None
            retry_after = response.headers.get("retry-after")
            retry_after_s = float(retry_after) if retry_after and retry_after.isdigit() else None
            if status_code != 200:
                error = (await response.aread()).decode(errors="replace")[:MAX_ERROR_CHARS]
            elif not request.stream:
                answer = json.loads(await response.aread())
                usage = answer.get("usage")
                pieces = [_choices_text(answer, "message")]
                num_text_events, saw_done = int(bool(pieces[0])), True  # one body: whole or an error status
                first_token_s = time.monotonic() - start_s
                if usage is None:
                    error = "the answer has no usage"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        saw_done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = json.dumps(chunk["error"])[:MAX_ERROR_CHARS]
                        break
                    text = _choices_text(chunk, "delta")
                    if text:
                        pieces.append(text)
                        num_text_events += 1
                        if first_token_s is None:
                            first_token_s = time.monotonic() - start_s
                        if num_text_events == request.cancel_after_events:
                            error = CANCELLED  # leaving the block closes the connection
                            break
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
        num_prompt_tokens=usage.get("prompt_tokens") if usage else None, overhead_ms=overhead_ms,
        retry_after_s=retry_after_s, num_text_events=num_text_events, saw_done=saw_done,
        output_digest=text_digest("".join(pieces)) if error is None else None)


async def drive(plan: LoadPlan, progress: tqdm | None = None, start_s: float | None = None) -> list[RequestResult]:
    """Send every request of the plan at its arrival time, at most `concurrency` at once; results in plan order.

    `start_s`: the monotonic time arrivals count from (default: now)."""
    slots = asyncio.Semaphore(plan.concurrency)
    limits = httpx.Limits(max_connections=plan.concurrency, max_keepalive_connections=plan.concurrency)
    # No read timeout: under max_reserve a request may wait minutes for KV room before its first byte.
    timeout = httpx.Timeout(None, connect=30.0)
    start_s = time.monotonic() if start_s is None else start_s

    async def one(http: httpx.AsyncClient, request: LoadRequest) -> RequestResult:
        await asyncio.sleep(max(0.0, start_s + request.arrival_s - time.monotonic()))
        async with slots:
            result = await _send(http, plan, request, start_s)
        if progress is not None:
            progress.update(1)
            if not result.is_ok and result.error != CANCELLED:  # a planned hang-up is no failure
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
    start_unix_s, start_s = time.time(), time.monotonic()
    with tqdm(total=len(plan.requests), desc=args.desc, unit="req") as progress:
        results = asyncio.run(drive(plan, progress, start_s))
    args.out.write_text(json.dumps({"start_unix_s": start_unix_s, "results": [asdict(r) for r in results]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
