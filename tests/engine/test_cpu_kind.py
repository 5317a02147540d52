"""What each CPU kind means for the same model (`workers.engine.cpu_kind`), through the `fake_cpu` fixture: what
dtype auto resolves to, the linear weights, the few-token kernel and the fused layer op; the decoder built on this
machine as each kind would build it; the AVX2 kind's kernels from a build of their own; and the code held to reading
the CPU in one place."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kv_kernels import cpu_build
from test_fast_decoder import _windowed_causal, assert_bf16_as_close_as_hf, fp32_logits  # one-sequence attention, checks
from workers.engine import cpu_kind
from workers.engine.fast_decoder import FastDecoder
from workers.engine.linear_weights import bf16_copy_bytes, has_bf16_linear_weights

REPO_ROOT = Path(__file__).resolve().parents[2]

# kind: (dtype auto, linear weights, few-token kernel, fused layer op), as the module's table says
SERVED = {
    "amx": ("bfloat16", "bf16, oneDNN-packed", "amx_linear", False),
    "avx512_bf16": ("bfloat16", "bf16, oneDNN-packed", "small_linear", False),
    "avx512": ("float32", "fp32", None, False),
    "avx2": ("float32", "bf16 values, widened to fp32", "bf16_weight_linear", True),
    "baseline": ("float32", "fp32", None, False),
}


def _worker_model(**changes):
    from workers.actors.worker_actor import load_worker_model
    from workers.actors.worker_settings import WorkerSettings

    return load_worker_model(WorkerSettings.of(tiny_model_seed=0, tiny_model_init_std=0.2, device="cpu",
                                               **changes))[0]


@pytest.mark.parametrize("name", sorted(SERVED))
def test_each_kind_resolves_the_same_model_its_own_way(fake_cpu, name):
    kind = fake_cpu(name, runs_kernels=False)
    assert kind.name == name
    path = kind.serves()
    assert (path.dtype, path.linear_weights, path.few_token_kernel, path.fused_layers) == SERVED[name]
    model = _worker_model()  # what a worker loads with dtype auto
    assert model.dtype == getattr(torch, path.dtype)
    assert has_bf16_linear_weights(model) == (name == "avx2")
    assert (bf16_copy_bytes(model) > 0) == (name == "avx2")  # the KV budget leaves the bf16 copy's memory out
    # asked for by name, a dtype is the same everywhere: fp32 weights stay fp32, bf16 has no widening
    assert not has_bf16_linear_weights(_worker_model(dtype="float32"))
    assert kind.serves("float32").describe() == (
        "dtype fp32, linear weights fp32, few-token kernel none, fused layer op no")
    assert kind.serves("bfloat16").dtype == "bfloat16" and not kind.serves("bfloat16").fused_layers


@pytest.mark.parametrize("name", sorted(SERVED))
def test_each_kind_builds_its_decoder_and_forwards_as_hugging_face(fake_cpu, name):
    kind = fake_cpu(name)  # skipped, saying which instructions, where this machine cannot run the kind's kernels
    path = kind.serves()
    built = cpu_build.native_kernels()
    if path.few_token_kernel in ("amx_linear", "small_linear") and path.few_token_kernel not in built:
        pytest.skip(f"needs {path.few_token_kernel} in the kernels' build (here: {', '.join(built) or 'none'})")
    model = _worker_model()
    fast = FastDecoder(model, max_positions=64)
    assert fast.dtype == getattr(torch, path.dtype)
    assert fast.few_token == path.few_token_kernel
    assert fast.reads_bf16_weights == (name == "avx2")
    assert fast.fused_layers == path.fused_layers
    assert fast.is_packed == path.linear_weights.endswith("oneDNN-packed")
    tokens = 24 if name == "amx" else 1  # within the few-token kernel's limit
    prompt = torch.randint(3, 256, (tokens,), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        want = model(prompt[None]).logits[0].float()  # [T, V]: HF's modules over the same weights
        got, _ = fast.forward(prompt, torch.arange(tokens), _windowed_causal(fast), torch.arange(tokens))
    if fast.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:
        assert_bf16_as_close_as_hf(got, want, fp32_logits(model, prompt))


def test_this_machines_build_runs_the_kernels_its_kind_names():
    built, named = set(cpu_build.native_kernels()), set(cpu_kind.this_cpu().native_kernels)
    if named - built == {"amx_linear"} and built <= named:
        pytest.skip("needs the AMX tile state, which Linux refused this process (the engine takes small_linear)")
    assert built == named


def test_a_kind_names_what_another_machine_lacks():
    avx2, amx = cpu_kind.KINDS["avx2"], cpu_kind.KINDS["amx"]
    assert avx2.missing_for(amx) == ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
    assert amx.missing_for(avx2) == ()
    assert [kind.name for kind in cpu_kind.KINDS.values()] == list(cpu_kind.KINDS)


def _source_files() -> list[Path]:
    folders = ("workers", "cluster", "kv_kernels", "benchmarks", "predictor_service", "s3serve_cli", "deploy")
    return sorted(path for folder in folders for path in (REPO_ROOT / folder).rglob("*.py"))


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def test_decisions_read_the_cpu_through_cpu_kind_at_the_moment_they_decide():
    """A fake kind reaches every decision only if nobody holds a copy of `this_cpu` or reads the CPU elsewhere."""
    offenders = []
    for path in _source_files() + sorted((REPO_ROOT / "tests").rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        name = path.relative_to(REPO_ROOT).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "workers.engine.cpu_kind":
                offenders += [f"{name}:{node.lineno} imports {alias.name} by name" for alias in node.names
                              if alias.name == "this_cpu"]
        for statement in tree.body:  # a call at module level (outside functions and classes): a copy taken at import
            # (a test module may read the real CPU, or `--cpu-kind`'s, at import for its skip reasons)
            if name.startswith("tests/") or isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                   ast.ClassDef)):
                continue
            offenders += [f"{name}:{node.lineno} calls this_cpu() at import" for node in ast.walk(statement)
                          if isinstance(node, ast.Call) and _called_name(node) == "this_cpu"]
        if not name.startswith("tests/") and name not in ("workers/engine/cpu_kind.py", "kv_kernels/cpu_build.py"):
            if "/proc/cpuinfo" in text:
                offenders.append(f"{name} reads /proc/cpuinfo")  # cpu_build reads it for its cache key only
            if "_native()" in text and name != "workers/engine/fast_linear.py":
                offenders.append(f"{name} asks the kernels' build what runs natively")  # fast_linear, with the kind
    assert not offenders, offenders


@pytest.mark.slow
def test_the_avx2_kind_passes_its_kernel_tests_on_a_build_for_avx2():
    """The AVX2 lanes (the widening linear, the fused layer op, the 8-lane elementwise kernels) compiled for
    x86-64-v3 and run by their tests, on any machine with AVX2 and FMA (`pytest --cpu-kind avx2`)."""
    real = cpu_kind.this_cpu()
    if real.name == "avx2":
        pytest.skip("this CPU is of kind avx2: the suite runs the AVX2 lanes on its own build")
    missing = real.missing_for(cpu_kind.KINDS["avx2"])
    if missing:
        pytest.skip(f"needs {' '.join(missing)}")
    modules = ["engine/test_bf16_weight_linear.py", "engine/test_fused_layers.py", "engine/test_cpu_kind.py",
               "engine/test_fast_decoder.py", "kernels/test_kv_kernels.py", "engine/test_row_argmax.py",
               "kernels/test_decode_attention_bf16.py"]
    result = subprocess.run([sys.executable, "-m", "pytest", "--cpu-kind", "avx2", "-p", "no:cacheprovider",
                             "-m", "not slow", "-k", "not triton", "-rs", *(f"tests/{m}" for m in modules)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, check=False)
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    assert "cpu kind: avx2" in result.stdout and "cpu kernels built natively: bf16_weight_linear\n" in result.stdout
    skips = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all("needs " in line for line in skips), skips  # only what an AVX2 CPU lacks
