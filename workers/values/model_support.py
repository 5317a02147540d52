"""What our engine cannot serve correctly, read from a model's config before any weight loads.

Our paged attention (`kv_kernels`: torch reference, C++ CPU, Triton) is a plain softmax over
a sequence's cached context, or over its last `window` keys for a sliding-window layer (what
Mistral, Qwen2, Phi-3 and Gemma 3's local layers pass as `sliding_window`). A model whose
attention does something else would run, and answer differently from its own implementation,
with no error: Gemma 2's capped attention logits, say. Such a model is refused in one line
that names what is missing, before any worker starts (`s3serve serve` checks the folder's
config first) and again wherever a model meets the engine (`ModelRunner`).

Pure decisions: `refusal` reads attributes of a transformers config (or anything shaped
like one) and imports nothing.
"""


def refusal(config) -> str | None:
    """Why this model cannot be served correctly (None: it can)."""
    if getattr(config, "auto_map", None):
        return ("its config.json names its own code (auto_map: remote code), which s3serve does not run; serve a "
                "model whose architecture transformers ships")
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = (quantization.get("quant_method", "?") if isinstance(quantization, dict)
                  else type(quantization).__name__)
        return f"its weights are quantized ({method}), which our engine does not load; serve unquantized weights"
    if getattr(config, "kv_lora_rank", None):
        return "it uses multi-head latent attention (kv_lora_rank), which our paged attention does not implement"
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        return (f"it caps attention logits (attn_logit_softcapping = {softcap}), which our paged attention does "
                "not: its answers would differ from the model's own")
    return None


def check_servable(config, model_name: str) -> None:
    """ValueError (one line, naming the model and what is missing) when `refusal` has a reason."""
    reason = refusal(config)
    if reason is not None:
        raise ValueError(f"cannot serve {model_name!r} correctly: {reason}")
