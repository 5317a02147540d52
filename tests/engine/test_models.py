"""Model folders: GGUF conversion (idempotent, safe when two processes race), local folders, the chat template.

The conversion tests are slow: one conversion takes ~25 s on CPU. The race runs
two conversions side by side once per session, and the other slow tests read its result.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from workers.engine.models import (COMPLETE_MARKER, convert_gguf, find_default_gguf, load_model, load_tokenizer,
                                   resolve_model_dir)

REPO_ROOT = Path(__file__).resolve().parents[2]
CONVERT_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from workers.engine.models import convert_gguf, find_default_gguf
    print(convert_gguf(find_default_gguf(), Path(sys.argv[1])))
    """
)


@pytest.fixture(scope="module")
def raced_conversion(tmp_path_factory) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """Two processes convert into the same fresh folder at the same time."""
    out_dir = tmp_path_factory.mktemp("race") / "m"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONVERT_SCRIPT, str(out_dir)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return out_dir, results


@pytest.mark.slow
def test_racing_conversions_both_succeed_into_one_complete_folder(raced_conversion):
    out_dir, results = raced_conversion
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip().splitlines()[-1] == str(out_dir)
    names = {path.name for path in out_dir.iterdir()}
    assert {"config.json", "model.safetensors", COMPLETE_MARKER} <= names
    assert any(name.startswith("tokenizer") for name in names)
    # Only the folder and its lock file remain: no half-written temporary copies.
    assert sorted(path.name for path in out_dir.parent.iterdir()) == ["m", "m.lock"]


@pytest.mark.slow
def test_converted_model_loads_and_runs(raced_conversion):
    out_dir, _ = raced_conversion
    assert resolve_model_dir(str(out_dir)) == out_dir
    model = load_model(out_dir)
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, model.config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.slow
def test_second_conversion_returns_without_rewriting(raced_conversion):
    out_dir, _ = raced_conversion
    weights = out_dir / "model.safetensors"
    mtime_ns = weights.stat().st_mtime_ns
    assert convert_gguf(find_default_gguf(), out_dir) == out_dir
    assert weights.stat().st_mtime_ns == mtime_ns  # found, not converted again


@pytest.mark.slow
def test_converted_tokenizer_has_a_chat_template(raced_conversion):
    tokenizer = load_tokenizer(raced_conversion[0])
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is a KV cache?"}], tokenize=False, add_generation_prompt=True
    )
    assert "What is a KV cache?" in text
    assert text.rstrip().endswith("assistant")
    token_ids = tokenizer.encode(text)
    assert tokenizer.decode(token_ids).count("What is a KV cache?") == 1


def test_folder_without_config_is_refused_with_a_clear_message(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"neither 'smollm2-135m-instruct', 'gemma3-270m', a local Hugging Face "
                                                r"folder with config.json, a .gguf file, nor a hub id"):
        resolve_model_dir(str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match=r"not in the local Hugging Face hub cache .*hub.*\(`hf download "
                                                r"HuggingFaceTB/SmolLM2-135M-Instruct`"):
        resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_a_hub_id_resolves_to_its_snapshot_in_the_local_hub_cache(tmp_path, monkeypatch):
    """Laid out as `hf download` leaves it: refs/main names the snapshot the files are in."""
    repo = tmp_path / "hub" / "models--someorg--tiny-llama"
    snapshot = repo / "snapshots" / ("ab" * 20)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("ab" * 20)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_dir("someorg/tiny-llama") == snapshot
    (snapshot / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model_dir("someorg/tiny-llama")


def test_local_folder_with_config_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path)) == tmp_path


def test_bench_prompts_for_a_base_model_are_the_messages_text(smollm2_dir):
    from benchmarks.prompt_pool import PromptRecord, encode_chat

    record = PromptRecord("pool:x-1", ({"role": "user", "content": "Name three rivers."},))
    base = load_tokenizer(smollm2_dir)
    base.chat_template = None  # as a base model's tokenizer comes (Gemma 3 270M's)
    assert base.decode(encode_chat(base, record)) == "Name three rivers."
    templated = load_tokenizer(smollm2_dir)
    chat = encode_chat(templated, record)
    assert "Name three rivers." in templated.decode(chat) and len(chat) > len(encode_chat(base, record))


def test_within_one_conversion_a_gguf_file_is_parsed_once(tmp_path):
    """transformers reads the file for the tokenizer, the config and the weights; the three share one parse."""
    import gguf
    import numpy as np

    from workers.engine.models import _one_gguf_parse

    paths = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    for path in paths:
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(50)])
        writer.add_tensor("w", np.arange(8, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    original = gguf.GGUFReader
    with _one_gguf_parse():
        first = gguf.GGUFReader(paths[0])
        assert gguf.GGUFReader(str(paths[0])) is first and gguf.GGUFReader(paths[1]) is not first
        assert len(first.fields["tokenizer.ggml.tokens"].data) == 50
    assert gguf.GGUFReader is original and gguf.GGUFReader(paths[0]) is not first
