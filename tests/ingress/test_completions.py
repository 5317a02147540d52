"""Both generation endpoints from parsed request to response body, over scripted worker streams (no Ray): choices
(`n`, `best_of`, several prompts), logprobs and echo in OpenAI's shapes (checked with the openai package's own
types), `created`, and failures (a worker failing after its first tokens is a 503 to retry; a detokenizer failing
is our bug, a 500)."""

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from cluster.ingress import openai_protocol as protocol
from cluster.ingress.completions import Completions
from cluster.ingress.errors import APIError
from workers.values.step_output import TokenLogprob
from workers.values.work_types import WorkEvent

MODEL_ID = "smollm2"


class ScriptedWorkers:
    """A `start_job` whose jobs answer `answer_ids` (two tokens per event; with `vary`, the k-th job started skips
    the first k - 1), logprob -0.1 * k per token (or `logprob_of(k)`), and record when each job started and which
    sibling it was placed beside."""

    def __init__(self, answer_ids: list[int], fail_after_first: bool = False, first_delay_s: float = 0.0,
                 vary: bool = False, logprob_of=lambda k: -0.1 * k) -> None:
        self.answer_ids = answer_ids
        self.vary = vary
        self.logprob_of = logprob_of
        self.first_delay_s = first_delay_s
        self.fail_after_first = fail_after_first
        self.started: list[tuple[str, str | None]] = []
        self.predicted_texts: list[str] = []
        self.sample_texts: list[str] = []  # what each job's training sample will read
        self.jobs: list = []
        self.first_event_of: set[str] = set()

    async def __call__(self, job, result):
        self.started.append((job.request_id, job.sibling_of))
        self.sample_texts.append(job.prompt_text)
        self.jobs.append(job)
        if job.sibling_of is not None:
            assert job.sibling_of in self.first_event_of  # the leader brought its first tokens before
        position = len(self.started)
        await asyncio.sleep(self.first_delay_s)
        tokens = self.answer_ids[position - 1 if self.vary else 0:][:job.params.max_tokens]
        for start in range(0, len(tokens), 2):
            chunk = tuple(tokens[start:start + 2])
            logprobs = None
            if job.params.logprobs is not None:
                top = tuple((token, -0.01 * (k + 1)) for k, token in enumerate(range(job.params.logprobs)))
                logprobs = tuple(TokenLogprob(token, self.logprob_of(position), top) for token in chunk)
            prompt_logprobs = None
            if start == 0 and job.params.prompt_logprobs is not None:
                prompt_logprobs = (None,) + tuple(TokenLogprob(t, -1.0) for t in job.prompt_token_ids[1:])
            result.output_token_ids.extend(chunk)
            await asyncio.sleep(0)
            self.first_event_of.add(job.request_id)
            yield WorkEvent(job.request_id, chunk, None, len(job.prompt_token_ids), len(result.output_token_ids),
                            logprobs=logprobs, prompt_logprobs=prompt_logprobs)
            if self.fail_after_first:
                raise RuntimeError("the worker reported an error")
        result.finish_reason = "length" if len(tokens) == job.params.max_tokens else "stop"


def make_completions(tokenizer, workers: ScriptedWorkers, prefix_caching: bool = True,
                     reasoning_parser: str | None = None) -> tuple[Completions, list]:
    observed = []
    config = SimpleNamespace(model_id=MODEL_ID, max_model_len=2048, default_max_tokens=64, max_concurrent_requests=8,
                             prefix_caching=prefix_caching, prefix_aware_placement=False, block_size=16,
                             reasoning_parser=reasoning_parser, tool_call_parser=None)
    metrics = SimpleNamespace(observe_status=observed.append, observe_overhead=lambda s: None,
                              observe_finished=lambda *args: observed.append("finished"))

    async def predict(request_id, text, num_prompt_tokens, params):
        workers.predicted_texts.append(text)
        return 32, 16

    return Completions(config, tokenizer, metrics, predict, workers, prefix_root=0), observed


def answer(completions: Completions, body: dict, is_chat: bool = False):
    model_cls = protocol.ChatCompletionRequest if is_chat else protocol.CompletionRequest
    req = model_cls.model_validate({"model": MODEL_ID, **body})
    response = asyncio.run(completions.answer(req, is_chat))
    return json.loads(response.body)


def stream(completions: Completions, body: dict, is_chat: bool = False) -> list[dict]:
    model_cls = protocol.ChatCompletionRequest if is_chat else protocol.CompletionRequest
    req = model_cls.model_validate({"model": MODEL_ID, "stream": True, **body})

    async def run() -> list[bytes]:
        response = await completions.answer(req, is_chat)
        events = [event async for event in response.body_iterator]
        await response.on_close()
        return events

    events = asyncio.run(run())
    assert events[-1] == protocol.SSE_DONE
    return [json.loads(event[len(b"data: "):]) for event in events[:-1]]


@pytest.fixture
def answer_ids(smollm2_tokenizer) -> list[int]:
    return smollm2_tokenizer.encode(" Paris is the capital of France.")


def test_a_collected_response_is_created_when_its_request_started(smollm2_tokenizer, answer_ids):
    workers = ScriptedWorkers(answer_ids, first_delay_s=2.0)
    completions, observed = make_completions(smollm2_tokenizer, workers)
    before_s = time.time()
    body = answer(completions, {"prompt": "The capital of France?"})
    Completion.model_validate(body)
    assert body["choices"][0]["text"] == " Paris is the capital of France."
    assert int(before_s) <= body["created"] <= before_s + 1 and time.time() - body["created"] >= 2
    assert completions.num_in_flight == 0 and observed == ["finished", "ok"]


def test_n_choices_are_sequences_of_their_own_placed_beside_the_first(smollm2_tokenizer, answer_ids):
    workers = ScriptedWorkers(answer_ids)
    completions, _ = make_completions(smollm2_tokenizer, workers)
    body = answer(completions, {"prompt": ["One?", "Two?"], "n": 3, "max_tokens": 4})
    parsed = Completion.model_validate(body)
    assert [choice.index for choice in parsed.choices] == list(range(6))
    assert {choice.text for choice in parsed.choices} == {smollm2_tokenizer.decode(answer_ids[:4])}
    leaders = [request_id for request_id, sibling in workers.started if sibling is None]
    assert len(leaders) == 2 and len(workers.started) == 6
    assert sorted(sibling for _, sibling in workers.started if sibling) == sorted(leaders * 2)
    one, two = (len(smollm2_tokenizer.encode(p)) for p in ("One?", "Two?"))
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens) == (one + two, 6 * 4)


def test_best_of_returns_the_n_of_highest_mean_logprob(smollm2_tokenizer, answer_ids):
    workers = ScriptedWorkers(answer_ids)
    completions, _ = make_completions(smollm2_tokenizer, workers)
    body = answer(completions, {"prompt": "Hi", "best_of": 3, "n": 2, "max_tokens": 4})
    assert len(workers.started) == 3 and len(body["choices"]) == 2
    assert [choice["logprobs"] for choice in body["choices"]] == [None, None]  # ranked by logprobs, not asked for
    with_logprobs = answer(completions, {"prompt": "Hi", "best_of": 3, "n": 2, "max_tokens": 4, "logprobs": 0})
    means = [sum(c["logprobs"]["token_logprobs"]) / 4 for c in with_logprobs["choices"]]
    assert means == pytest.approx([-0.4, -0.5])  # the 4th and 5th jobs started; the 6th (-0.6) is dropped


def test_best_of_ranks_by_logprobs_not_asked_for(smollm2_tokenizer, answer_ids):
    workers = ScriptedWorkers(answer_ids, vary=True, logprob_of=lambda k: -1.0 / k)  # the later, the likelier
    completions, _ = make_completions(smollm2_tokenizer, workers)
    body = answer(completions, {"prompt": "Hi", "best_of": 3, "n": 2, "max_tokens": 4})
    assert [choice["text"] for choice in body["choices"]] == [smollm2_tokenizer.decode(answer_ids[2:6]),
                                                              smollm2_tokenizer.decode(answer_ids[1:5])]
    assert [choice["index"] for choice in body["choices"]] == [0, 1]


@pytest.mark.parametrize("prefix_caching, body", [(False, {}), (True, {"echo": True, "logprobs": 1})])
def test_siblings_start_at_once_when_they_could_share_nothing(smollm2_tokenizer, answer_ids, prefix_caching, body):
    workers = ScriptedWorkers(answer_ids)
    completions, _ = make_completions(smollm2_tokenizer, workers, prefix_caching)
    answer(completions, {"prompt": "Hi", "n": 3, "max_tokens": 2, **body})
    assert [sibling for _, sibling in workers.started] == [None, None, None]


def test_completion_logprobs_and_echo_in_openai_shape(smollm2_tokenizer, answer_ids):
    completions, _ = make_completions(smollm2_tokenizer, ScriptedWorkers(answer_ids))
    body = answer(completions, {"prompt": "Hello world", "echo": True, "logprobs": 2, "max_tokens": 3})
    # openai-python types these lists as non-null, but the API (and vLLM) send null for the first echoed token, and
    # the client does not validate responses: read the body as sent.
    raw = body["choices"][0]
    choice = SimpleNamespace(text=raw["text"], logprobs=SimpleNamespace(**raw["logprobs"]))
    prompt_ids = smollm2_tokenizer.encode("Hello world")
    assert choice.text == "Hello world" + smollm2_tokenizer.decode(answer_ids[:3])
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:len(prompt_ids)] == [-1.0] * (len(prompt_ids) - 1)
    assert logprobs.token_logprobs[len(prompt_ids):] == pytest.approx([-0.1] * 3)
    assert all(len(top) in (2, 3) for top in logprobs.top_logprobs[len(prompt_ids):])  # the sampled one joins
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(smollm2_tokenizer, answer_ids):
    completions, _ = make_completions(smollm2_tokenizer, ScriptedWorkers(answer_ids))
    body = answer(completions, {"prompt": [[5, 6, 7]], "echo": True, "logprobs": 0, "max_tokens": 0})
    choice = body["choices"][0]
    assert choice["text"] == smollm2_tokenizer.decode([5, 6, 7])
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -1.0]
    assert body["usage"]["completion_tokens"] == 0


def test_chat_logprobs_in_openai_shape_streamed_and_not(smollm2_tokenizer, answer_ids):
    completions, _ = make_completions(smollm2_tokenizer, ScriptedWorkers(answer_ids))
    request = {"messages": [{"role": "user", "content": "Capital?"}], "logprobs": True, "top_logprobs": 2,
               "max_tokens": 5}
    content = ChatCompletion.model_validate(answer(completions, request, is_chat=True)).choices[0].logprobs.content
    assert [entry.token for entry in content] == [smollm2_tokenizer.decode([t]) for t in answer_ids[:5]]
    assert all(len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode()) for entry in content)
    chunks = [ChatCompletionChunk.model_validate(c) for c in stream(completions, {**request, "n": 2}, is_chat=True)]
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        streamed = [entry for c in mine if c.logprobs for entry in c.logprobs.content]
        assert [entry.token for entry in streamed] == [entry.token for entry in content]
        assert "".join(c.delta.content or "" for c in mine) == smollm2_tokenizer.decode(answer_ids[:5])


def test_the_length_predictor_reads_that_an_answer_is_constrained_and_so_does_its_training_sample(
        smollm2_tokenizer, answer_ids):
    workers = ScriptedWorkers(answer_ids)
    completions, _ = make_completions(smollm2_tokenizer, workers)
    answer(completions, {"prompt": "Hi", "max_tokens": 2})
    answer(completions, {"prompt": "Hi", "max_tokens": 2, "guided_regex": ".*"})
    assert workers.predicted_texts == ["Hi", "Hi\n\n[structured output: regex]"]
    assert workers.sample_texts == workers.predicted_texts


def test_a_generation_that_fails_after_its_first_tokens_is_a_503(smollm2_tokenizer, answer_ids):
    completions, observed = make_completions(smollm2_tokenizer, ScriptedWorkers(answer_ids, fail_after_first=True))
    with pytest.raises(APIError) as raised:
        answer(completions, {"messages": [{"role": "user", "content": "Hi"}]}, is_chat=True)
    assert raised.value.status_code == 503 and "RuntimeError" in raised.value.body()["error"]["message"]
    assert completions.num_in_flight == 0 and observed == []  # counted by status where it is answered


def test_a_detokenizer_failure_is_our_error_not_a_503_to_retry(smollm2_tokenizer, answer_ids):
    """The generation succeeded; retrying it would fail the same way, so the error reaches the app's handler
    (a 500 internal_error) instead of being answered as a worker that went away."""

    class BrokenDecode:
        def __len__(self):
            return len(smollm2_tokenizer)

        def __call__(self, text, **kwargs):
            return smollm2_tokenizer(text, **kwargs)

        def decode(self, ids, **kwargs):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad vocabulary entry")

    completions, observed = make_completions(BrokenDecode(), ScriptedWorkers(answer_ids))
    with pytest.raises(UnicodeDecodeError):
        answer(completions, {"prompt": "Hi"})
    assert completions.num_in_flight == 0 and "ok" not in observed


def test_chat_with_a_model_that_has_no_template_is_a_400_and_a_template_file_fixes_it(smollm2_dir, tmp_path):
    from workers.engine.models import load_tokenizer

    chat = protocol.ChatCompletionRequest.model_validate({"model": MODEL_ID,
                                                         "messages": [{"role": "user", "content": "Hi"}]})
    base = load_tokenizer(smollm2_dir)
    base.chat_template = None  # as a base model's tokenizer comes
    with pytest.raises(APIError) as raised:
        make_completions(base, ScriptedWorkers([]))[0]._encode_chat(chat)
    assert raised.value.status_code == 400 and "no chat template" in str(raised.value.message)
    assert "--chat-template" in str(raised.value.message)
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    templated = load_tokenizer(smollm2_dir, str(template))
    prompt = make_completions(templated, ScriptedWorkers([]))[0]._encode_chat(chat)
    assert templated.decode(prompt.token_ids) == "user: Hi\nassistant:"
    assert prompt.echo_text == ""  # chat answers never echo


@pytest.mark.parametrize("default_max_tokens, expected", [(None, 2048), (64, 64)])
def test_an_unset_max_tokens_is_the_rest_of_the_context_as_in_vllm_or_the_configured_default(
        smollm2_tokenizer, answer_ids, default_max_tokens, expected):
    workers = ScriptedWorkers(answer_ids)
    completions, _ = make_completions(smollm2_tokenizer, workers)
    completions.config.default_max_tokens = default_max_tokens
    answer(completions, {"prompt": "Hello world"})
    num_prompt = len(workers.jobs[0].prompt_token_ids)
    assert workers.jobs[0].params.max_tokens == (expected - num_prompt if default_max_tokens is None else expected)


class _BosTokenizer:
    """SmolLM2's tokenizer as one whose own setting adds a BOS token to a text (Llama's and Gemma's do)."""

    def __init__(self, inner, bos_id: int) -> None:
        self.inner, self.bos_id = inner, bos_id

    def __call__(self, text, add_special_tokens: bool = True):
        ids = self.inner(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": [self.bos_id] * add_special_tokens + ids}

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_text_prompt_gets_the_tokenizers_own_bos_unless_asked_not_to_as_in_vllm(smollm2_tokenizer, answer_ids):
    tokenizer = _BosTokenizer(smollm2_tokenizer, bos_id=1)
    text_ids = smollm2_tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    for body, expected in (({}, [1, *text_ids]), ({"add_special_tokens": False}, text_ids)):
        workers = ScriptedWorkers(answer_ids)
        answer(make_completions(tokenizer, workers)[0], {"prompt": "Hello world", "max_tokens": 2, **body})
        assert list(workers.jobs[0].prompt_token_ids) == expected
    with pytest.raises(Exception, match="'add_special_tokens' is not supported"):  # the chat template places them
        protocol.ChatCompletionRequest.model_validate({"model": MODEL_ID, "add_special_tokens": True,
                                                       "messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize("is_streamed", [False, True])
def test_stop_reason_names_the_stop_and_include_stop_str_in_output_keeps_it(smollm2_tokenizer, answer_ids,
                                                                            is_streamed):
    def run(body: dict) -> tuple[str, str, object]:
        completions = make_completions(smollm2_tokenizer, ScriptedWorkers(answer_ids))[0]
        if not is_streamed:
            choice = answer(completions, {"prompt": "Hi", "max_tokens": 40, **body})["choices"][0]
            return choice["text"], choice["finish_reason"], choice["stop_reason"]
        chunks = [c for c in stream(completions, {"prompt": "Hi", "max_tokens": 40, **body}) if c.get("choices")]
        last = chunks[-1]["choices"][0]
        return "".join(c["choices"][0]["text"] for c in chunks), last["finish_reason"], last["stop_reason"]

    assert run({"stop": ["capital"]}) == (" Paris is the ", "stop", "capital")
    assert run({"stop": ["capital"], "include_stop_str_in_output": True}) == (" Paris is the capital", "stop",
                                                                             "capital")
    assert run({"stop_token_ids": [answer_ids[-1]]})[1:] == ("stop", answer_ids[-1])  # the token that ended it
    assert run({})[1:] == ("stop", None)  # the model's own end: no stop_reason


def test_return_token_ids_gives_the_prompts_and_the_answers_ids_as_vllm(smollm2_tokenizer, answer_ids):
    prompt_ids = smollm2_tokenizer("Hi")["input_ids"]
    completions = make_completions(smollm2_tokenizer, ScriptedWorkers(answer_ids))[0]
    choice = answer(completions, {"prompt": "Hi", "max_tokens": 40, "return_token_ids": True})["choices"][0]
    assert choice["token_ids"] == answer_ids and choice["prompt_token_ids"] == prompt_ids
    chat = answer(make_completions(smollm2_tokenizer, ScriptedWorkers(answer_ids))[0],
                  {"messages": [{"role": "user", "content": "Hi"}], "return_token_ids": True}, is_chat=True)
    assert chat["choices"][0]["token_ids"] == answer_ids and chat["prompt_token_ids"][-1] != answer_ids[0]
    chunks = [c for c in stream(make_completions(smollm2_tokenizer, ScriptedWorkers(answer_ids))[0],
                                {"prompt": "Hi", "max_tokens": 40, "return_token_ids": True}) if c.get("choices")]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == answer_ids
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    plain = answer(make_completions(smollm2_tokenizer, ScriptedWorkers(answer_ids))[0], {"prompt": "Hi"})
    assert "token_ids" not in plain["choices"][0]


def test_skip_special_tokens_false_keeps_them_in_the_text(smollm2_tokenizer):
    ids = smollm2_tokenizer("Done", add_special_tokens=False)["input_ids"] + [smollm2_tokenizer.eos_token_id]
    body = {"prompt": "Hi", "max_tokens": 10}
    assert answer(make_completions(smollm2_tokenizer, ScriptedWorkers(ids))[0], body)["choices"][0]["text"] == "Done"
    kept = answer(make_completions(smollm2_tokenizer, ScriptedWorkers(ids))[0], {**body, "skip_special_tokens": False})
    assert kept["choices"][0]["text"] == "Done" + smollm2_tokenizer.eos_token


def test_prompt_logprobs_in_vllms_form_on_both_endpoints(smollm2_tokenizer, answer_ids):
    workers = ScriptedWorkers(answer_ids)
    choice = answer(make_completions(smollm2_tokenizer, workers)[0],
                    {"prompt": "Hello world", "max_tokens": 4, "prompt_logprobs": 2})["choices"][0]
    prompt_ids = list(workers.jobs[0].prompt_token_ids)
    assert workers.jobs[0].params.prompt_logprobs == 2 and choice["prompt_logprobs"][0] is None
    assert [list(entry) for entry in choice["prompt_logprobs"][1:]] == [[str(t)] for t in prompt_ids[1:]]
    second = choice["prompt_logprobs"][1][str(prompt_ids[1])]
    assert second == {"logprob": -1.0, "rank": None, "decoded_token": smollm2_tokenizer.decode(prompt_ids[1:2])}
    chat = answer(make_completions(smollm2_tokenizer, ScriptedWorkers(answer_ids))[0],
                  {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 0}, is_chat=True)
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3
    with pytest.raises(Exception, match="not a stream"):
        protocol.CompletionRequest.model_validate({"model": MODEL_ID, "prompt": "Hi", "stream": True,
                                                   "prompt_logprobs": 1})


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(smollm2_tokenizer, answer_ids):
    body = {"prompt": "Hi", "max_tokens": 40, "stream_options": {"include_usage": True,
                                                                 "continuous_usage_stats": True}}
    chunks = stream(make_completions(smollm2_tokenizer, ScriptedWorkers(answer_ids))[0], body)
    with_choices = [c for c in chunks if c.get("choices")]
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == len(answer_ids) and counts[0] <= 2
    assert chunks[-1]["usage"]["completion_tokens"] == len(answer_ids)  # the last usage chunk, as before
    plain = stream(make_completions(smollm2_tokenizer, ScriptedWorkers(answer_ids))[0],
                   {"prompt": "Hi", "max_tokens": 40})
    assert all("usage" not in c or c["usage"] is None for c in plain)
