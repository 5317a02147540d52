"""The tiny-engine helpers the engine tests share: budgets in blocks, prompts, draining, HF's greedy tokens.

Budgets are given in blocks: the tiny model's block of 4 tokens takes
2 (K and V) * 2 layers * 4 tokens * 2 kv heads * 16 head_dim * 4 bytes = 2048 bytes.
"""

import copy
import random

import torch

from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM, Phi3Config,
                          Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from workers.engine.engine import Engine, EngineConfig, StepOutput
from workers.engine.models import make_tiny_model, redraw_matrices
from workers.values.sampling_params import SamplingParams

BLOCK_SIZE = 4
BYTES_PER_BLOCK = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
VOCAB = 256

WINDOW = 8  # tokens: the tiny architectures' sliding window; prompts and answers run well past it
SHAPE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
ARCHITECTURES = {
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**SHAPE, sliding_window=WINDOW)),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=WINDOW,
                                                    max_window_layers=1)),  # layer 0 global, layer 1 sliding
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**SHAPE, head_dim=16)),  # QK norm
    "phi3": (Phi3ForCausalLM, lambda: Phi3Config(**SHAPE, sliding_window=WINDOW, pad_token_id=0)),
    "gemma3": (Gemma3ForCausalLM, lambda: Gemma3TextConfig(
        **SHAPE, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention"])),
}


def make_model(seed: int = 0, vocab_size: int = VOCAB) -> torch.nn.Module:
    """The tiny random Llama with its weights redrawn at std 0.2.

    At its default init (std 0.02) the tiny model echoes the last prompt token
    whatever comes before it, so its greedy tokens would match HF even if
    attention read the wrong KV blocks; at std 0.2 every token depends on the context.
    """
    return make_tiny_model(seed, vocab_size=vocab_size, init_std=0.2)


def make_engine(
    model: torch.nn.Module,
    num_blocks: int = 64,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 64,
    max_model_len: int | None = None,
    eos_token_id: int | None = None,
    tokenizer=None,
) -> Engine:
    """An engine over a private copy of `model` (the engine rewires the attention of the model it gets)."""
    model = copy.deepcopy(model)
    if eos_token_id is not None:
        model.generation_config.eos_token_id = eos_token_id
    config = EngineConfig.of(
        kv_cache_bytes=num_blocks * BYTES_PER_BLOCK,
        block_size=BLOCK_SIZE,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
    )
    return Engine(model, config, tokenizer=tokenizer)


def make_prompt(num_tokens: int, seed: int, vocab_size: int = VOCAB) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(num_tokens)]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run_engine(
    engine: Engine,
    requests: dict[str, tuple[list[int], SamplingParams]],
    arrivals: dict[int, list[str]],
    max_steps: int = 2000,
) -> dict[str, StepOutput]:
    """Add each request at its step, step until done; return every request's last StepOutput.

    Checks that a request streams exactly the tokens its last output lists, and
    that it yields nothing after it finished.
    """
    streamed: dict[str, list[int]] = {}
    final: dict[str, StepOutput] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        assert step < max_steps, "the engine stopped making progress"
        for seq_id in arrivals.get(step, []):
            prompt, params = requests[seq_id]
            engine.add_request(prompt, params, seq_id=seq_id)
        for out in engine.step():
            assert out.seq_id not in final, f"{out.seq_id} produced a token after finishing"
            streamed.setdefault(out.seq_id, []).append(out.token_id)
            if out.is_finished:
                final[out.seq_id] = out
        step += 1
    for seq_id, out in final.items():
        assert list(out.output_token_ids) == streamed[seq_id]
    return final


def drain(engine: Engine, max_steps: int = 500) -> list[StepOutput]:
    """Step until every request finished; fail instead of spinning if the engine stalls."""
    outputs = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        outputs.extend(engine.step())
    raise AssertionError(f"still unfinished after {max_steps} steps")


def assert_pool_empty(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    engine.allocator.check_invariants()


def tiny_architecture(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny fp32 model of one of ARCHITECTURES, built from transformers' own config class (no download), weights
    redrawn at std 0.2 so that every token depends on its context; it runs all its tokens (no EOS), as the engine
    does with ignore_eos."""
    model_cls, make_config = ARCHITECTURES[name]
    torch.manual_seed(seed)
    model = model_cls(make_config()).eval()
    redraw_matrices(model, seed, 0.2)
    model.generation_config.eos_token_id = None
    return model


def hf_greedy_runner(tiny_model: torch.nn.Module):
    """HF greedy `generate`, one prompt at a time, on its own copy with sdpa attention (memoised), on the model's
    device."""
    from transformers import GenerationConfig

    model = copy.deepcopy(tiny_model)
    model.set_attn_implementation("sdpa")
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in memo:
            generation_config = GenerationConfig(
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=2
            )
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt], device=model.device), generation_config=generation_config)
            tokens = out[0, len(prompt):].tolist()
            assert len(tokens) == max_new_tokens
            memo[key] = tokens
        return memo[key]

    return run


def sliding_window(config) -> int | None:
    """The sliding window some layer of a model with this config attends within, as transformers applies it (the
    kernels' `window`), or None when every layer attends to the whole context."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None  # Qwen2 and Qwen3 carry a window they do not use unless use_sliding_window is set
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def byte_tokenizer():
    """A fast tokenizer whose 256 tokens are the bytes (ids 0..255) and whose EOS is id 256: a real vocabulary for a
    tiny model, so grammars run against it without model files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda char: _byte_of(char))
    vocab = {char: byte for byte, char in enumerate(byte_chars)}
    vocab["</s>"] = 256
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")


def _byte_of(char: str) -> int:
    """GPT-2's byte-to-character map, inverted: printable bytes map to themselves, the rest to 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    code = ord(char)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
