"""Scoring, several choices and structured output through the whole service (real Ray, Redis and SmolLM2 in
float32), with the official `openai` client: logprobs of answers and of echoed prompts equal a log-softmax of the
HF model's own logits, `n` choices share their prompt's KV blocks on one worker, several prompts and best_of come
back in OpenAI's order, constrained answers match their schemas, regexes and choices, and tool calls come back in
OpenAI's shape."""

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from json_schemas import random_schema
from pydantic import BaseModel

from cluster.config import CONTROLLER_NAME, RAY_NAMESPACE, ServiceConfig
from cluster.service import start_service, stop_service
from workers.actors.ports import free_port
from workers.engine.grammar_masks import GrammarMasks
from workers.engine.models import load_tokenizer, resolve_model_dir
from workers.values.sampling_params import GrammarSpec

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TOLERANCE = 2e-3  # float32: the service's paged attention and fused kernels against HF's eager forward
PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
          "movable metal type, oil-based ink and a wooden press adapted from those used for wine. Within fifty "
          "years, printing had spread across Europe, and")


@pytest.fixture(scope="module")
def service(tmp_path_factory, model_cache_dir):
    config = ServiceConfig(
        port=free_port(), num_workers=2, model_cache_dir=str(model_cache_dir), max_model_len=512, dtype="float32",
        kv_cache_memory=64 * 1024**2, default_max_tokens=16, data_dir=str(tmp_path_factory.mktemp("s3serve-data")),
        num_cpus=8, num_torch_threads=1, stats_interval_s=0.25)
    running = start_service(config, ready_timeout_s=600, progress=lambda _msg: None)
    yield running
    stop_service(running)


@pytest.fixture(scope="module")
def client(service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf(model_cache_dir):
    folder = resolve_model_dir(MODEL, model_cache_dir)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), load_tokenizer(folder)


def _log_softmax(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)  # [T, vocab]


def test_answer_and_echoed_prompt_logprobs_are_the_models_log_softmax(client, hf):
    model, tokenizer = hf
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True,
                                       logprobs=3)
    choice = result.choices[0]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0]
    assert choice.text.startswith(PROMPT) and choice.text[len(PROMPT):] == plain.text
    logprobs = choice.logprobs
    assert len(logprobs.token_logprobs) == len(prompt_ids) + 8 and logprobs.token_logprobs[0] is None
    generated = tokenizer(choice.text[len(PROMPT):], add_special_tokens=False)["input_ids"]
    reference = _log_softmax(model, prompt_ids + generated)
    targets = (prompt_ids + generated)[1:]
    for position, value in enumerate(logprobs.token_logprobs[1:len(prompt_ids) + len(generated)]):
        assert value == pytest.approx(reference[position, targets[position]].item(), abs=TOLERANCE), position
    for position, top in enumerate(logprobs.top_logprobs[len(prompt_ids):len(prompt_ids) + len(generated)]):
        row = reference[len(prompt_ids) - 1 + position]
        best = max(top.values())
        assert best == pytest.approx(row.max().item(), abs=TOLERANCE)  # greedy: the sampled token is the top one
    scored = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == PROMPT and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == pytest.approx(logprobs.token_logprobs[:len(prompt_ids)],
                                                                      abs=TOLERANCE)


def test_chat_logprobs_through_the_official_client(client, hf):
    result = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                            max_tokens=6, temperature=0, logprobs=True, top_logprobs=4)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    assert "".join(entry.token for entry in content).startswith(result.choices[0].message.content[:3])
    assert all(len(entry.top_logprobs) == 4 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
               for entry in content)  # greedy picks the most likely token


def _prefix_hit_tokens() -> int:
    controller = ray.get_actor(CONTROLLER_NAME, namespace=RAY_NAMESPACE)
    return sum(stats.num_prefix_hit_tokens for stats in ray.get(controller.status.remote(), timeout=60).stats)


def test_n_choices_share_the_prompts_blocks_and_stream_by_index(client, service, hf):
    _, tokenizer = hf
    num_prompt_tokens = len(tokenizer(PROMPT + " n", add_special_tokens=False)["input_ids"])
    hits_before = _prefix_hit_tokens()
    result = client.completions.create(model=MODEL, prompt=PROMPT + " n", n=4, max_tokens=12, temperature=1.0, seed=3)
    assert sorted(choice.index for choice in result.choices) == [0, 1, 2, 3]
    assert result.usage.prompt_tokens == num_prompt_tokens and result.usage.completion_tokens == 48
    # The three siblings, placed beside the first, read its full prompt blocks from the prefix cache.
    full_blocks_tokens = num_prompt_tokens // 16 * 16
    hits = 0
    for _ in range(40):  # the workers' stats arrive every 0.25 s
        hits = _prefix_hit_tokens() - hits_before
        if hits >= 3 * full_blocks_tokens:
            break
        httpx.get(f"{service.base_url}/health", timeout=30)
    assert hits >= 3 * full_blocks_tokens
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", n=2, max_tokens=5, stream=True,
                                            temperature=0))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts[0] == texts[1] and texts[0]  # greedy: the same answer twice


def test_several_prompts_and_best_of_come_back_in_openais_order(client):
    prompts = ["One, two,", "Monday, Tuesday,"]
    result = client.completions.create(model=MODEL, prompt=prompts, n=2, best_of=3, max_tokens=4, temperature=1.0,
                                       seed=5, logprobs=1)
    assert [choice.index for choice in result.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text
               for p in prompts]
    greedy = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0)
    assert [choice.text for choice in greedy.choices] == singles  # choice i answers prompt i
    for first, second in ((0, 1), (2, 3)):  # best first within each prompt
        mean = [sum(result.choices[i].logprobs.token_logprobs) / 4 for i in (first, second)]
        assert mean[0] >= mean[1]


def test_thirty_seeded_json_schemas_are_always_answered_in_their_shape(client, hf):
    rng = random.Random(20261126)
    schemas = [random_schema(rng) for _ in range(30)]

    def ask(index: int):
        schema = schemas[index]
        result = client.chat.completions.create(
            model=MODEL, max_tokens=300, temperature=0.7 if index % 2 else 0.0, seed=index,
            messages=[{"role": "user", "content": f"Describe thing number {index} in JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema,
                                                                    "strict": True}})
        return result.choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(ask, range(30)))
    model, tokenizer = hf
    grammars = GrammarMasks(tokenizer, model.config.vocab_size)
    for index, (schema, choice) in enumerate(zip(schemas, choices)):
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
        else:  # cut at max_tokens, yet every token so far is one the schema's grammar allows
            assert choice.finish_reason == "length"
            token_ids = tokenizer(choice.message.content, add_special_tokens=False)["input_ids"]
            # as a moved request resumes: ValueError if the grammar refuses a token
            grammars.add(f"s{index}", GrammarSpec("json_schema", json.dumps(schema)), token_ids)
    grammars.close()
    # Whether an answer ends is the model's choice: SmolLM2 once padded a number bounded by 10 with zeros
    # ("10.000...", all the grammar allows after "10.") until max_tokens, in one CI run of many.
    assert sum(choice.finish_reason == "stop" for choice in choices) >= 27, [c.message.content for c in choices]


class Person(BaseModel):
    name: str
    age: int


def test_the_official_clients_parse_and_vllms_guided_fields(client):
    parsed = client.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Ada, 36."}],
                                                response_format=Person, max_tokens=120, temperature=0)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person)
    answer = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert answer.choices[0].text in ("yes", "no")
    code = client.completions.create(model=MODEL, prompt="A postcode:", max_tokens=12, temperature=1.0,
                                     extra_body={"structured_outputs": {"regex": "[0-9]{5}"}})
    assert re.fullmatch("[0-9]{5}", code.choices[0].text)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="x", extra_body={"guided_json": {"type": "object",
                                                                                      "dependentRequired": {}}})
    assert raised.value.body["param"] == "guided_json" and "dependentRequired" in raised.value.body["message"]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


def test_a_tool_call_streamed_and_collected_by_the_official_client(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "weather"}}
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL],
                                                tool_choice=named, max_tokens=40, temperature=0, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    assert calls[0]["name"] == "weather" and isinstance(json.loads(calls[0]["arguments"])["city"], str)
    required = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL],
                                              tool_choice="required", max_tokens=60, temperature=0)
    call = required.choices[0].message.tool_calls[0]
    assert required.choices[0].finish_reason == "tool_calls" and call.function.name == "weather"
    # The result goes back as a tool message; the model answers in text.
    follow = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, tools=[WEATHER_TOOL],
                                            tool_choice="none", messages=[
        *messages, required.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}])
    assert follow.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=8)
    assert raised.value.body["param"] == "tool_choice"  # auto: SmolLM2 has no tool-call format of its own
