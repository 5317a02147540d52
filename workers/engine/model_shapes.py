"""Randomly initialised models of real shapes, for benchmarks whose numbers do not depend on weight values.

With output lengths forced, a decode step costs what the shape costs (weights and KV
bytes moved, FLOPs) whatever the weights are, so `bench policies --model-shape llama-7b
--device cuda` measures the paper's regime without downloading 13 GB of weights. Every
shape is built in the Llama layout (GQA attention, SwiGLU MLP, RMSNorm, rotary); "gptj-6b"
has GPT-J-6B's sizes, not its parallel attention block.
"""

MODEL_SHAPES: dict[str, dict[str, int]] = {
    # For tests and CPU runs: the tiny shape of `workers.engine.models.tiny_llama_config`.
    "tiny": dict(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=16, vocab_size=256),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152),
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, head_dim=128, vocab_size=32000),
    "gptj-6b": dict(hidden_size=4096, intermediate_size=16384, num_hidden_layers=28, num_attention_heads=16,
                    num_key_value_heads=16, head_dim=256, vocab_size=50400),
    # LLaMA-13B and -30B (also called 33B): on one 80 GB GPU their weights leave room for fewer sequences
    # of KV, the regime where the S3 paper measured its largest gains.
    "llama-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=40, head_dim=128, vocab_size=32000),
    "llama-30b": dict(hidden_size=6656, intermediate_size=17920, num_hidden_layers=60, num_attention_heads=52,
                      num_key_value_heads=52, head_dim=128, vocab_size=32000),
}


def shape_parameters(name: str) -> int:
    """Parameters of a shape (embeddings tied to the output layer), for reports."""
    shape = _shape(name)
    hidden, heads, kv_heads, head_dim = (shape["hidden_size"], shape["num_attention_heads"],
                                         shape["num_key_value_heads"], shape["head_dim"])
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * shape["intermediate_size"]
    return shape["num_hidden_layers"] * (attention + mlp + 2 * hidden) + shape["vocab_size"] * hidden + hidden


def make_shaped_model(name: str, vocab_size: int | None = None, dtype=None, device: str = "cpu",
                      max_position_embeddings: int = 4096, seed: int = 0):
    """A random Llama-layout model of shape `name`, built directly on `device` in `dtype` (eval mode).

    `vocab_size`: at least the shape's (raised so a tokenizer with more ids can feed it).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(_shape(name))
    shape["vocab_size"] = max(shape["vocab_size"], vocab_size or 0)
    config = LlamaConfig(**shape, max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    dtype = torch.float32 if dtype is None else dtype
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def _shape(name: str) -> dict[str, int]:
    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose from {', '.join(MODEL_SHAPES)}")
    return MODEL_SHAPES[name]
