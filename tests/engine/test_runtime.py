"""The engine's process runtime: dtype per device and CPU, and the tuning every launcher applies."""

import pytest
import torch

from workers.engine import runtime


@pytest.mark.parametrize("kind, dtype", [("amx", torch.bfloat16), ("avx512_bf16", torch.bfloat16),
                                         ("avx512", torch.float32), ("avx2", torch.float32),
                                         ("baseline", torch.float32)])
def test_auto_dtype_follows_the_cpu_kind(fake_cpu, kind, dtype):
    fake_cpu(kind, runs_kernels=False)
    assert runtime.resolve_dtype("auto", "cpu") == dtype
    assert runtime.resolve_dtype("auto", "cpu", "float16") == dtype  # no fp16 arithmetic on a CPU


def test_auto_dtype_on_cuda_keeps_the_models_half_type(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert runtime.resolve_dtype("auto", "cuda", "float16") == torch.float16  # a model trained in fp16
    assert runtime.resolve_dtype("auto", "cuda", "bfloat16") == torch.bfloat16
    assert runtime.resolve_dtype("auto", "cuda", "float32") == torch.bfloat16  # served in half, as vLLM does
    assert runtime.resolve_dtype("auto", "cuda", None) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)  # a V100, a T4
    assert runtime.resolve_dtype("auto", "cuda", "bfloat16") == torch.float16


def test_a_model_folders_stated_dtype_is_read(tmp_path):
    import json

    from workers.engine.models import config_dtype

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert config_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"dtype": "bfloat16"}}))
    assert config_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text("{}")
    assert config_dtype(tmp_path) is None


def test_explicit_dtypes_and_a_bad_name():
    assert runtime.resolve_dtype("float32", "cpu") == torch.float32
    assert runtime.resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"):
        runtime.resolve_dtype("fp8", "cpu")


def test_tuning_sets_threads_to_the_usable_cores_and_can_be_told_otherwise():
    before = torch.get_num_threads()
    try:
        assert runtime.tune_cpu_runtime() == runtime.usable_cores() == torch.get_num_threads()
        assert runtime.tune_cpu_runtime(1) == 1 == torch.get_num_threads()
        with pytest.raises(ValueError, match="num_threads must be >= 1"):
            runtime.tune_cpu_runtime(-2)
    finally:
        torch.set_num_threads(before)
