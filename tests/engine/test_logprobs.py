"""Logprobs of sampled and prompt tokens against a log-softmax of the HF model's own logits (fp32, tiny models)."""

import copy

import pytest
import torch

from tests.engine_driver import BLOCK_SIZE, BYTES_PER_BLOCK, make_model, make_prompt, run_engine, tiny_architecture
from workers.engine.engine import Engine
from workers.scheduling.engine_config import EngineConfig
from workers.values.sampling_params import SamplingParams

TOLERANCE = 1e-4  # fp32: the engine's paged attention against HF's eager one


def _engine(model, fast: bool, num_blocks: int = 64, max_num_seqs: int = 4, chunk_tokens: int = 64,
            preemption_mode: str = "auto") -> Engine:
    config = EngineConfig.of(kv_cache_bytes=num_blocks * BYTES_PER_BLOCK, block_size=BLOCK_SIZE,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk_tokens, use_fast_path=fast,
                          preemption_mode=preemption_mode)
    return Engine(copy.deepcopy(model), config)


def _hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log-softmax of HF's logits over the whole sequence: row p is the distribution of token p + 1 [T, vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()  # [T, vocab]
    return logits.log_softmax(dim=-1)


def _check(logprob, reference_row: torch.Tensor, token: int, count: int) -> None:
    assert logprob.token_id == token
    assert logprob.logprob == pytest.approx(reference_row[token].item(), abs=TOLERANCE)
    values, ids = reference_row.topk(count)
    assert len(logprob.top) == count
    for (top_id, top_value), ref_id, ref_value in zip(logprob.top, ids.tolist(), values.tolist()):
        assert top_value == pytest.approx(ref_value, abs=TOLERANCE)
        assert top_id == ref_id or reference_row[top_id].item() == pytest.approx(ref_value, abs=TOLERANCE)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "hf"])
def test_sampled_tokens_logprobs_are_the_models_raw_log_softmax(fast):
    model = make_model()
    engine = _engine(model, fast)
    requests = {
        "greedy": (make_prompt(9, seed=1), SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5)),
        # temperature, penalties and bias shape the pick, not the reported distribution (vLLM's raw logprobs)
        "sampled": (make_prompt(14, seed=2), SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.5,
                                                             seed=7, logprobs=3, presence_penalty=1.0,
                                                             logit_bias=((5, 20.0),))),
        "plain": (make_prompt(6, seed=3), SamplingParams(max_tokens=4, ignore_eos=True)),
    }
    seen = {seq_id: [] for seq_id in requests}
    for seq_id, (prompt, params) in requests.items():
        engine.add_request(prompt, params, seq_id=seq_id)
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.seq_id].append(out)
    assert all(out.logprob is None and out.prompt_logprobs is None for out in seen["plain"])
    for seq_id in ("greedy", "sampled"):
        prompt, params = requests[seq_id]
        tokens = [out.token_id for out in seen[seq_id]]
        reference = _hf_logprobs(model, prompt + tokens)
        for i, out in enumerate(seen[seq_id]):
            _check(out.logprob, reference[len(prompt) - 1 + i], out.token_id, params.logprobs)
            assert out.prompt_logprobs is None  # not asked for


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_prompt_logprobs_score_every_prompt_token_across_chunks_and_cached_prefixes(name):
    model = make_model() if name == "llama" else tiny_architecture(name)
    engine = _engine(model, fast=True, chunk_tokens=8)  # the 30-token prompts take four chunks
    prompt = make_prompt(30, seed=4)
    # The same prompt cached first: the scored request must still compute (and score) every position.
    engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True), seq_id="warm")
    run_engine(engine, {}, {0: []})
    engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2, logprobs=0),
                       seq_id="scored")
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    assert engine.scheduler.stats.num_prefix_hit_tokens == 0
    first, *rest = outputs
    assert all(out.prompt_logprobs is None for out in rest)  # handed out once, with the first token
    scored = first.prompt_logprobs
    assert len(scored) == len(prompt) and scored[0] is None
    reference = _hf_logprobs(model, prompt + [out.token_id for out in outputs])
    for position in range(1, len(prompt)):
        _check(scored[position], reference[position - 1], prompt[position], 2)
    for i, out in enumerate(outputs):
        _check(out.logprob, reference[len(prompt) - 1 + i], out.token_id, 0)


def test_prompt_logprobs_survive_preemption_and_come_once():
    """Recompute preemption redoes a prompt already scored: nothing is scored twice or lost."""
    model = make_model()
    engine = _engine(model, fast=True, num_blocks=14, max_num_seqs=3, chunk_tokens=8, preemption_mode="recompute")
    requests = {f"r{i}": (make_prompt(10 + 3 * i, seed=10 + i),
                          SamplingParams(max_tokens=14, ignore_eos=True, prompt_logprobs=1)) for i in range(3)}
    first: dict[str, object] = {}
    for seq_id, (prompt, params) in requests.items():
        engine.add_request(prompt, params, seq_id=seq_id)
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.seq_id not in first
                first[out.seq_id] = out.prompt_logprobs
    assert engine.scheduler.num_preemptions > 0
    for seq_id, (prompt, _) in requests.items():
        reference = _hf_logprobs(model, prompt)
        assert len(first[seq_id]) == len(prompt)
        for position in range(1, len(prompt)):
            _check(first[seq_id][position], reference[position - 1], prompt[position], 1)


def test_logprob_counts_out_of_range_are_refused():
    with pytest.raises(ValueError, match="logprobs must be None or an integer in \\[0, 20\\]"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
