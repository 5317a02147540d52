"""Tool calls through the whole service (real Ray, Redis and SmolLM2) with a Hermes-format chat template written for
the test and `--tool-call-parser hermes`: an "auto" answer with two calls, its text kept to the calls by a regex
(SmolLM2 was never taught the format), streamed to the official client as argument fragments that join to the
whole answer's calls."""

import json

import openai
import pytest

from cluster.config import ServiceConfig
from cluster.service import start_service, stop_service
from test_tool_calls import HERMES_TEMPLATE
from workers.actors.ports import free_port

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ONE_CALL = r'<tool_call>\{"name": "weather", "arguments": \{"city": "(Paris|Rome|Oslo)"\}\}</tool_call>'


@pytest.fixture(scope="module")
def client(tmp_path_factory, model_cache_dir):
    folder = tmp_path_factory.mktemp("s3serve-tools")
    template = folder / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    config = ServiceConfig(
        port=free_port(), num_workers=1, model_cache_dir=str(model_cache_dir), max_model_len=512,
        kv_cache_memory=32 * 1024**2, dtype="float32", data_dir=str(folder / "data"), num_cpus=4,
        num_torch_threads=1, chat_template=str(template), tool_call_parser="hermes")
    running = start_service(config, ready_timeout_s=600, progress=lambda _msg: None)
    yield openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="none", max_retries=0, timeout=300)
    stop_service(running)


def test_auto_calls_stream_as_fragments_through_the_service(client):
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in two cities?"}],
              "tools": [WEATHER], "max_tokens": 96, "temperature": 0.0,
              "extra_body": {"guided_regex": ONE_CALL + "\n" + ONE_CALL}}
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert [call.function.name for call in whole.message.tool_calls] == ["weather", "weather"]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [delta for chunk in chunks for delta in chunk.choices[0].delta.tool_calls or ()]
    assert [(d.index, d.function.name) for d in deltas if d.id] == [(0, "weather"), (1, "weather")]
    for index, call in enumerate(whole.message.tool_calls):
        fragments = [d.function.arguments for d in deltas if d.index == index and d.function.arguments]
        assert len(fragments) > 1 and "".join(fragments) == call.function.arguments  # greedy: the same calls
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome", "Oslo")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(chunk.choices[0].delta.content for chunk in chunks)
