"""KV export/import between engines: a sequence continued elsewhere gives the tokens it would have given at home.

The tiny random Llama's weights are redrawn at std 0.2 (see tests/engine_driver.py):
at its default init it echoes the last token, which would hide KV read from
the wrong blocks.
"""

import copy
import random

import pytest
import torch

from workers.engine.engine import Engine, EngineConfig
from workers.engine.kv_transfer import ExportedKV
from workers.scheduling.policies import make_policy
from workers.values.sampling_params import SamplingParams

BLOCK_SIZE = 4
BYTES_PER_BLOCK = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def make_engine(model: torch.nn.Module, num_blocks: int = 64, policy=None, block_size: int = BLOCK_SIZE,
                preemption_mode: str = "auto") -> Engine:
    config = EngineConfig.of(kv_cache_bytes=num_blocks * BYTES_PER_BLOCK * block_size // BLOCK_SIZE,
                          block_size=block_size, max_num_seqs=4, max_num_batched_tokens=16,
                          preemption_mode=preemption_mode)
    return Engine(copy.deepcopy(model), config, policy=policy)


def make_prompt(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(num_tokens)]


def run_until(engine: Engine, seq_id: str, num_output_tokens: int | None = None) -> list[int]:
    """Step until `seq_id` has `num_output_tokens` outputs (or finished); return its outputs."""
    tokens = list(engine.sequence(seq_id).output_token_ids)
    for _ in range(500):
        if num_output_tokens is not None and len(tokens) >= num_output_tokens:
            return tokens
        for out in engine.step():
            if out.seq_id == seq_id:
                if out.is_finished:
                    return list(out.output_token_ids)
                tokens.append(out.token_id)
    raise AssertionError("no progress")


def drain_outputs(engine: Engine) -> dict[str, list[int]]:
    finished = {}
    for _ in range(500):
        if not engine.has_unfinished():
            return finished
        finished.update({o.seq_id: list(o.output_token_ids) for o in engine.step() if o.is_finished})
    raise AssertionError("no progress")


@pytest.mark.parametrize("num_before_move", [1, 6, 9])
@pytest.mark.parametrize("with_kv", [True, False], ids=["kv", "recompute"])
def test_sequence_continued_on_another_engine_gives_the_same_greedy_tokens(tiny_model, num_before_move, with_kv):
    prompt, params = make_prompt(7, seed=1), SamplingParams(max_tokens=16, ignore_eos=True)
    home = make_engine(tiny_model)
    expected = home.generate([prompt], params)[0]

    source, target = make_engine(tiny_model), make_engine(tiny_model)
    source.add_request(prompt, params, seq_id="a")
    source.add_request(make_prompt(11, seed=2), params, seq_id="neighbour")  # shares the pool and the batches
    sent = run_until(source, "a", num_before_move)
    kv = source.export_sequence("a")
    assert kv.num_computed_tokens == len(prompt) + len(sent) - 1  # the last token is not computed yet
    assert kv.num_blocks == source.allocator.blocks_for(kv.num_computed_tokens)
    assert source.abort("a")
    source.allocator.check_invariants()

    target.add_request(make_prompt(5, seed=3), params, seq_id="other")
    target.step()  # the importer's pool is already in use: the KV lands in other blocks
    target.add_request(prompt, params, seq_id="a", resumed_output_token_ids=sent, kv=kv if with_kv else None)
    finished = drain_outputs(target)
    assert finished["a"] == expected
    assert finished["a"][: len(sent)] == sent
    if with_kv:
        assert target.swapped_bytes == kv.num_blocks * target.runner.pool_shape.bytes_per_block
    else:
        assert target.swapped_bytes == 0
    assert target.allocator.num_free_blocks == target.allocator.num_blocks
    target.allocator.check_invariants()


def test_kv_of_a_swapped_out_sequence_is_its_host_copy(tiny_model):
    # The sequence outruns a 2-token prediction in a pool too small to grow: s3 swaps it out.
    source = make_engine(tiny_model, num_blocks=6, policy=make_policy("s3", bucket_tokens=4), preemption_mode="swap")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = {"a": make_prompt(6, seed=4), "b": make_prompt(6, seed=5)}
    for seq_id, prompt in prompts.items():
        source.add_request(prompt, params, seq_id=seq_id, predicted_output_tokens=2)
    swapped = None
    for _ in range(100):
        source.step()
        swapped = next((s for s in source.scheduler.waiting if s.is_swapped), None)
        if swapped is not None:
            break
    assert swapped is not None, "nothing was swapped out"
    kv = source.export_sequence(swapped.seq_id)
    assert kv.num_computed_tokens == swapped.num_computed_tokens > 0
    sent = list(swapped.output_token_ids)
    source.abort(swapped.seq_id)

    target = make_engine(tiny_model)
    target.add_request(prompts[swapped.seq_id], params, seq_id="moved", resumed_output_token_ids=sent, kv=kv)
    expected = make_engine(tiny_model).generate([prompts[swapped.seq_id]], params)[0]
    assert drain_outputs(target)["moved"] == expected


def test_a_waiting_sequence_exports_no_kv(tiny_model):
    engine = make_engine(tiny_model)
    engine.add_request(make_prompt(5, seed=6), SamplingParams(max_tokens=4), seq_id="a")
    kv = engine.export_sequence("a")
    assert (kv.num_computed_tokens, kv.num_blocks, kv.layers) == (0, 0, ())
    with pytest.raises(ValueError, match="'nope' is unknown"):
        engine.export_sequence("nope")


def test_more_kv_than_known_tokens_is_cut_to_the_known_prefix(tiny_model):
    prompt, params = make_prompt(9, seed=7), SamplingParams(max_tokens=10, ignore_eos=True)
    expected = make_engine(tiny_model).generate([prompt], params)[0]
    source = make_engine(tiny_model)
    source.add_request(prompt, params, seq_id="a")
    run_until(source, "a", 6)
    kv = source.export_sequence("a")
    # The client got only 2 of the 6 tokens (say, the rest were lost with the stream).
    target = make_engine(tiny_model)
    target.add_request(prompt, params, seq_id="a", resumed_output_token_ids=expected[:2], kv=kv)
    assert target.sequence("a").num_computed_tokens == len(prompt) + 1
    assert drain_outputs(target)["a"] == expected


def test_imports_that_cannot_fit_are_refused_and_change_nothing(tiny_model):
    source = make_engine(tiny_model)
    prompt, params = make_prompt(9, seed=8), SamplingParams(max_tokens=10, ignore_eos=True)
    source.add_request(prompt, params, seq_id="a")
    run_until(source, "a", 3)
    kv = source.export_sequence("a")
    other_blocks = make_engine(tiny_model, block_size=8)
    with pytest.raises(ValueError, match="block_size 4 cannot enter a pool with 2 layers and block_size 8"):
        other_blocks.add_request(prompt, params, seq_id="a", kv=kv)
    half = ExportedKV(tuple((k.half(), v.half()) for k, v in kv.layers), kv.num_computed_tokens, kv.block_size)
    with pytest.raises(ValueError, match="dtype torch.float16"):
        make_engine(tiny_model).add_request(prompt, params, seq_id="a", kv=half)
    with pytest.raises(ValueError, match="10 resumed output tokens leave nothing to generate"):
        make_engine(tiny_model).add_request(prompt, params, seq_id="a", resumed_output_token_ids=[3] * 10)
    with pytest.raises(ValueError, match="resumed output token ids must lie in"):
        make_engine(tiny_model).add_request(prompt, params, resumed_output_token_ids=[256])
    with pytest.raises(ValueError, match=r"needs K and V of shape \[1, 4"):
        ExportedKV(kv.layers, 3, 4)
    assert not other_blocks.has_unfinished() and not other_blocks.runner.swapped_copy("a")
