"""The GPU path, written once and run on both devices: Triton kernels against the reference, the engine's mixed
prefill + decode steps against HF greedy, sliding-window models against HF greedy, swapping KV blocks to host memory
and back, the length probe reading hidden states on the device, and grammars masking logits where they are.

`make test` runs the CPU variants (Triton through its interpreter, the engine on the CPU backend), so the tests'
logic is checked on every machine; the CUDA variants carry the `gpu` marker: `make test` deselects them and
`make test-gpu` runs them on a CUDA machine (torch, triton and transformers installed, no network needed).
"""

import copy
import json
import re

import pytest
import torch

from engine_driver import byte_tokenizer, hf_greedy_runner, make_prompt, run_engine, tiny_architecture
from kv_kernels import reference, triton_kernels
from workers.engine.engine import Engine
from workers.engine.model_runner import pool_shape_for
from workers.engine.models import make_tiny_model
from workers.scheduling.engine_config import EngineConfig
from workers.values.sampling_params import GrammarSpec, SamplingParams

DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
BLOCK_SIZE = 4
BYTES_PER_BLOCK = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # layers x (K, V) x block x KV heads x head dim x fp32


def _shuffled_tables(context_lens: list[int], block_size: int, num_blocks: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(-(-n // block_size) for n in context_lens)
    table = torch.zeros((len(context_lens), width), dtype=torch.int32)
    for row, length in enumerate(context_lens):
        for col in range(-(-length // block_size)):
            table[row, col] = free.pop()
    return table


@DEVICES
def test_triton_decode_and_prefill_match_the_reference(device):
    generator = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 6, 2, 64, 16, 40
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(device)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(device)
    scale = head_dim**-0.5
    lens = [1, 16, 17, 40, 33]
    tables = _shuffled_tables(lens, block_size, num_blocks, seed=1).to(device)
    context = torch.tensor(lens, dtype=torch.int32, device=device)
    query = torch.randn(len(lens), num_heads, head_dim, generator=generator).to(device)  # [S, H, D]
    got = triton_kernels.paged_decode_attention(query, k_cache, v_cache, tables, context, scale)
    want = reference.paged_decode_attention(query, k_cache, v_cache, tables, context, scale)
    assert got.device.type == device
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)

    chunks, prefixes = [1, 16, 7, 3], [0, 16, 3, 30]
    tables = _shuffled_tables([p + c for p, c in zip(prefixes, chunks)], block_size, num_blocks, seed=2).to(device)
    cu_seqlens = torch.tensor([0] + chunks, dtype=torch.int64).cumsum(0).to(device)
    prefix_lens = torch.tensor(prefixes, dtype=torch.int32, device=device)
    query = torch.randn(sum(chunks), num_heads, head_dim, generator=generator).to(device)  # [T, H, D]
    got = triton_kernels.prefill_attention(query, k_cache, v_cache, cu_seqlens, prefix_lens, tables, scale)
    want = reference.prefill_attention(query, k_cache, v_cache, cu_seqlens, prefix_lens, tables, scale)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def _hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=2)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), generation_config=config)
    return out[0, len(prompt):].tolist()


@DEVICES
def test_engine_mixed_steps_equal_hf_greedy_and_swap_round_trips(device):
    """Requests join mid-prefill and mid-decode (chunked prefill beside decodes in one step); every sequence's
    greedy tokens equal HF's on the same device; blocks swapped to host memory come back bit-identical."""
    model = make_tiny_model(seed=0, init_std=0.2).to(device)
    reference_model = copy.deepcopy(model)
    reference_model.set_attn_implementation("sdpa")
    engine = Engine(copy.deepcopy(model), EngineConfig.of(kv_cache_bytes=64 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE,
                                                       max_num_seqs=4, max_num_batched_tokens=16))
    assert engine.runner.backend.name == ("triton" if device == "cuda" else "cpu")
    assert engine.runner.kv_caches[0][0].device.type == device
    generator = torch.Generator().manual_seed(3)
    shapes = {"a": (5, 7), "b": (17, 3), "c": (3, 12), "d": (26, 5)}
    prompts = {name: torch.randint(0, 256, (n,), generator=generator).tolist() for name, (n, _) in shapes.items()}
    arrivals = {0: ["a", "b"], 2: ["c"], 3: ["d"]}
    tokens: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        assert step < 500, "the engine stopped making progress"
        for name in arrivals.get(step, []):
            engine.add_request(prompts[name], SamplingParams(max_tokens=shapes[name][1], ignore_eos=True),
                               seq_id=name)
        for out in engine.step():
            tokens.setdefault(out.seq_id, []).append(out.token_id)
        step += 1
    for name, (_, num_out) in shapes.items():
        assert tokens[name] == _hf_greedy(reference_model, prompts[name], num_out), name

    runner = engine.runner
    with torch.no_grad():
        for k_cache, v_cache in runner.kv_caches:
            k_cache.normal_()
            v_cache.normal_()
    before = [(k[[1, 5, 6]].clone(), v[[1, 5, 6]].clone()) for k, v in runner.kv_caches]
    assert runner.swap_out("s", [1, 5, 6]) == 3 * runner.pool_shape.bytes_per_block
    with torch.no_grad():
        for k_cache, v_cache in runner.kv_caches:
            k_cache.zero_()
            v_cache.zero_()
    runner.swap_in("s", [7, 2, 9])
    for (k_cache, v_cache), (k_before, v_before) in zip(runner.kv_caches, before):
        assert torch.equal(k_cache[[7, 2, 9]], k_before) and torch.equal(v_cache[[7, 2, 9]], v_before)


@DEVICES
def test_the_length_probe_reads_hidden_states_where_the_engine_runs(device, synthetic_probe_features):
    """The engine's rows stay on the device; the probe (a host model) takes them from there."""
    from cluster.control.worker_probe import PredictorLengthProbe
    from predictor_service.hidden_probe import HiddenStateProbe, ProbeConfig
    from workers.scheduling.s3_peak import S3PeakPolicy

    model = make_tiny_model(seed=9, init_std=0.2).to(device)
    probe = HiddenStateProbe(ProbeConfig(max_len=128, hidden_units=8, num_epochs=1, interval_tokens=4),
                             hidden_size=model.config.hidden_size).fit(synthetic_probe_features(30, 96, seed=9))
    engine = Engine(model, EngineConfig.of(kv_cache_bytes=64 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE, max_model_len=128),
                    policy=S3PeakPolicy(bucket_tokens=8), probe=PredictorLengthProbe(probe))
    seq_id = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=12, ignore_eos=True))
    engine.step()
    assert engine.runner.device.type == device and engine.num_probe_reads == 1
    assert 1 <= engine.sequence(seq_id).predicted_output_tokens <= 12


@DEVICES
@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_sliding_window_models_answer_as_hf_where_the_engine_runs(device, name):
    """Mistral's window on every layer and Gemma 3's sliding layers between global ones, through the fast path
    and, on CUDA, the Triton kernels (prefill chunks and decodes, preemption), token for token as HF's sdpa on
    the same device."""
    model = tiny_architecture(name).to(device)
    hf_greedy = hf_greedy_runner(model)
    requests = {f"r{i}": (make_prompt(6 + 5 * i, seed=200 + i), SamplingParams(max_tokens=32, ignore_eos=True))
                for i in range(4)}
    bytes_per_block = pool_shape_for(model.config, 1, BLOCK_SIZE, torch.float32).bytes_per_block
    engine = Engine(copy.deepcopy(model), EngineConfig.of(kv_cache_bytes=20 * bytes_per_block, block_size=BLOCK_SIZE,
                                                       max_num_seqs=3, max_num_batched_tokens=8, max_model_len=128))
    assert engine.runner.backend.name == ("triton" if device == "cuda" else "cpu")
    assert engine.runner.path == "fast", engine.runner.fast_path_off_reason
    outputs = run_engine(engine, requests, {0: list(requests)})
    for seq_id, (prompt, params) in requests.items():
        assert list(outputs[seq_id].output_token_ids) == hf_greedy(prompt, params.max_tokens), (name, seq_id)
    assert engine.scheduler.num_preemptions > 0


@DEVICES
def test_constrained_answers_keep_to_their_grammar_where_the_engine_runs(device):
    """Grammar masks (built on the host) applied to the device's logits: greedy and sampled rows, with logprobs,
    beside an unconstrained row, all end complete and match their grammar."""
    tokenizer = byte_tokenizer()
    model = make_tiny_model(seed=1, vocab_size=len(tokenizer), init_std=0.2).to(device)
    engine = Engine(model, EngineConfig.of(kv_cache_bytes=256 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE, max_num_seqs=8,
                                        max_num_batched_tokens=64), tokenizer=tokenizer)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "pets": {"type": "array", "maxItems": 2,
                                                        "items": {"enum": ["cat", "dog"]}}},
              "required": ["name", "pets"], "additionalProperties": False}
    specs = {f"json{i}": GrammarSpec("json_schema", json.dumps(schema)) for i in range(2)}
    specs["regex"] = GrammarSpec("regex", "[A-Z][a-z]{2,5} [0-9]{2}")
    prompt = tokenizer("A record:", add_special_tokens=False)["input_ids"]
    for i, (seq_id, spec) in enumerate(specs.items()):
        engine.add_request(prompt, SamplingParams(max_tokens=120, temperature=1.0 if i else 0.0, seed=i, logprobs=0,
                                                  grammar=spec), seq_id=seq_id)
    engine.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True), seq_id="free")
    finished = {}
    for _ in range(500):
        finished.update({out.seq_id: out for out in engine.step() if out.is_finished})
        if not engine.has_unfinished():
            break
    for seq_id in specs:
        text = tokenizer.decode(finished[seq_id].output_token_ids, skip_special_tokens=True)
        assert finished[seq_id].finish_reason == "stop", (seq_id, text)
        if seq_id.startswith("json"):
            answer = json.loads(text)
            assert set(answer) == {"name", "pets"} and len(answer["name"]) <= 6, text
        else:
            assert re.fullmatch("[A-Z][a-z]{2,5} [0-9]{2}", text), text
    assert finished["free"].finish_reason == "length" and not engine.grammars
