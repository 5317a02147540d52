"""Structured output in the engine: the bitmask applied to logits against a plain reference, the matchers on
SmolLM2's tokenizer (what a grammar allows, when it is complete, a moved request's tokens), and the engine's
constrained answers with the real model (they match their grammar, whatever the sampling)."""

import json
import re

import jsonschema
import pytest
import torch

from kv_kernels import cpu_build
from workers.engine.grammar_masks import GrammarMasks, mask_disallowed
from workers.values.sampling_params import GrammarSpec, SamplingParams


@pytest.mark.parametrize("kernel", ["c++", "torch"])
def test_mask_disallowed_leaves_only_the_allowed_tokens_of_the_constrained_rows(kernel, monkeypatch):
    if kernel == "c++":
        cpu_build.load()
    else:
        monkeypatch.setattr(cpu_build, "is_loaded", lambda: False)
    logits = torch.randn(3, 80, dtype=torch.bfloat16)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)  # the matcher knows 64 tokens: 64..79 are never allowed
    for token in (0, 33, 63):
        bitmask[0, token // 32] |= torch.tensor(1 << (token % 32), dtype=torch.int64).to(torch.int32)
    masked = mask_disallowed(logits, [1], bitmask)
    reference = logits.float()
    reference[1] = float("-inf")
    reference[1, [0, 33, 63]] = logits.float()[1, [0, 33, 63]]
    assert torch.equal(masked, reference)
    assert masked.dtype == torch.float32 and not torch.equal(masked, logits)  # a copy: logprobs read the original


def test_a_grammar_wins_where_min_tokens_bans_would_leave_a_row_nothing():
    from workers.engine.sampling import Sampler

    logits = torch.randn(2, 64)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # the grammar allows token 5 alone, which is EOS here
    params = [SamplingParams(max_tokens=8, min_tokens=4), SamplingParams(max_tokens=8, min_tokens=4, temperature=1.0)]
    picks = Sampler(frozenset({5})).sample(logits, ["a", "b"], params, [([1], []), ([1], [])],
                                           ([0, 1], torch.cat([bitmask, bitmask])))
    assert picks == [5, 5]  # not NaN, not a token outside the grammar


def test_masks_computed_during_the_forward_follow_the_rows_order(smollm2_tokenizer):
    masks = GrammarMasks(smollm2_tokenizer, 49152)
    masks.add("digits", GrammarSpec("regex", "[0-9]+"), [])
    masks.add("yes", GrammarSpec("choice", json.dumps(["yes"])), [])
    masks.begin(["yes", "digits"])  # the scheduler's order
    rows, overlapped = masks.allowed(["digits", "free", "yes"])  # the forward's
    rows_again, direct = masks.allowed(["digits", "free", "yes"])  # nothing pending: computed here
    assert rows == rows_again == [0, 2] and torch.equal(overlapped, direct)
    masks.close()


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_choice_allows_its_own_tokens_and_is_complete_after_them(smollm2_tokenizer):
    masks = GrammarMasks(smollm2_tokenizer, 49152)
    masks.add("a", GrammarSpec("choice", json.dumps(["yes please", "no"])), [])
    rows, bitmask = masks.allowed(["free", "a"])
    assert rows == [1]
    allowed = mask_disallowed(torch.zeros(2, 49152), rows, bitmask)[1] > float("-inf")
    assert allowed[_ids(smollm2_tokenizer, "yes")[0]] and allowed[_ids(smollm2_tokenizer, "no")[0]]
    assert not allowed[_ids(smollm2_tokenizer, "maybe")[0]]
    tokens = _ids(smollm2_tokenizer, "yes please")
    assert [masks.advance("a", token) for token in tokens] == [False] * (len(tokens) - 1) + [True]
    masks.forget("a")
    assert not masks and masks.allowed(["a"]) is None


def test_a_moved_request_resumes_its_grammar_and_bad_input_is_refused(smollm2_tokenizer):
    masks = GrammarMasks(smollm2_tokenizer, 49152)
    spec = GrammarSpec("regex", "[0-9]{4}")
    digits = _ids(smollm2_tokenizer, "12")
    masks.add("moved", spec, digits)
    assert not masks.advance("moved", _ids(smollm2_tokenizer, "3")[0])
    with pytest.raises(ValueError, match="the resumed output does not match the grammar"):
        masks.add("wrong", spec, _ids(smollm2_tokenizer, "ab"))
    with pytest.raises(ValueError, match="needs an engine built with a tokenizer"):
        GrammarMasks(None, 49152).add("x", spec, [])


@pytest.mark.slow
def test_the_engine_answers_match_their_grammar_greedy_and_sampled(smollm2_dir, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    from workers.engine.engine import Engine
    from workers.engine.models import chat_token_ids
    from workers.scheduling.engine_config import EngineConfig

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    engine = Engine(model, EngineConfig.of(kv_cache_bytes=128 * 2**20, max_model_len=1024), tokenizer=smollm2_tokenizer)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "pets": {"type": "array", "maxItems": 2,
                                                        "items": {"enum": ["cat", "dog"]}}},
              "required": ["name", "age", "pets"], "additionalProperties": False}
    prompt = list(chat_token_ids(smollm2_tokenizer, [{"role": "user", "content": "A person as JSON, please."}]))
    specs = {f"json{i}": GrammarSpec("json_schema", json.dumps(schema)) for i in range(3)}
    specs["regex"] = GrammarSpec("regex", "[A-Z][a-z]{2,5} [0-9]{2}")
    for i, (seq_id, spec) in enumerate(specs.items()):
        engine.add_request(prompt, SamplingParams(max_tokens=200, temperature=1.0 if i else 0.0, seed=i, logprobs=0,
                                                  grammar=spec), seq_id=seq_id)
    engine.add_request(prompt, SamplingParams(max_tokens=8), seq_id="free")  # unconstrained, beside them
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.is_finished:
                finished[out.seq_id] = out
    for seq_id in specs:
        text = smollm2_tokenizer.decode(finished[seq_id].output_token_ids, skip_special_tokens=True)
        assert finished[seq_id].finish_reason == "stop", (seq_id, text)
        if seq_id.startswith("json"):
            jsonschema.validate(json.loads(text), schema)
        else:
            assert re.fullmatch("[A-Z][a-z]{2,5} [0-9]{2}", text), text
    assert finished["free"].finish_reason == "length" and not engine.grammars
