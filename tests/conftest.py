"""Shared test setup.

TRITON_INTERPRET must be set before any Triton kernel is defined so that the
kernels run on CPU tensors through Triton's interpreter; HF_HUB_OFFLINE keeps
transformers from reaching for the network.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def pytest_addoption(parser):
    from workers.engine.cpu_kind import KINDS

    parser.addoption("--cpu-kind", choices=sorted(KINDS), default=None,
                     help="run the tests as on a CPU of this kind (workers/engine/cpu_kind.py): every CPU decision "
                          "reads that kind, and the C++ kernels are built for its x86 level and loaded (this "
                          "machine needs the kind's instructions; an AVX-512 or AMX machine runs avx2)")


def _run_as_cpu_kind(config, name: str) -> None:
    """The whole run on a CPU of kind `name`: the kind faked for every decision, the kernels built for it."""
    import torch

    from kv_kernels import cpu_build
    from workers.engine import cpu_kind

    kind = cpu_kind.KINDS[name]
    missing = cpu_kind.this_cpu().missing_for(kind)
    if missing:
        raise pytest.UsageError(f"--cpu-kind {name} needs {' '.join(missing)}, which this CPU lacks")
    torch.ops.load_library(str(cpu_build.build(march=cpu_kind.KIND_MARCH[name])))
    patch = pytest.MonkeyPatch()
    patch.setattr(cpu_kind, "this_cpu", lambda: kind)
    config.add_cleanup(patch.undo)


def pytest_configure(config):
    """Under pytest-xdist each worker gets its share of the cores for torch's threads (at least one).

    With two workers on two cores, each running torch's default of one thread per core, a parallel
    region waits at its barrier for a thread the other worker has descheduled: tiny-model tests ran
    5-25 times slower than alone. Processes a test starts set their own threads (`tune_cpu_runtime`).
    """
    if config.getoption("--cpu-kind"):
        _run_as_cpu_kind(config, config.getoption("--cpu-kind"))
    num_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if num_workers > 1:
        import torch

        from workers.engine.runtime import usable_cores

        torch.set_num_threads(max(1, usable_cores() // num_workers))


def pytest_report_header(config) -> list[str]:
    """The CPU kind the suite runs on and the kernel paths that means, first in every report (`make test`)."""
    from kv_kernels import cpu_build
    from workers.engine import cpu_kind

    cpu = cpu_kind.this_cpu()
    decisive = " ".join(flag for flag in cpu_kind.DECISIVE_FLAGS if flag in cpu.flags) or "none of them"
    lines = [f"cpu kind: {cpu.name} ({cpu.model_name or 'model unknown'}; decisive flags: {decisive}; "
             f"C++ kernels' vectors: {cpu.vector_isa})",
             f"cpu path for dtype auto: {cpu.serves().describe()}"]
    if not (cpu_build.is_loaded() or cpu_build.library_path().is_file()):
        return [*lines, "cpu kernels: not built yet (the first test that needs them builds them)"]
    cpu_build.load()
    built = cpu_build.native_kernels()
    lines.append(f"cpu kernels built natively: {', '.join(built) or 'none of the kind-specific ones'}")
    if set(built) != set(cpu.native_kernels):
        lines.append(f"cpu kernels: the build differs from the kind's {', '.join(cpu.native_kernels) or 'none'} "
                     "(AMX tile state refused by Linux, or a compiler without the instructions)")
    return lines


@pytest.fixture
def fake_cpu(monkeypatch):
    """`fake_cpu(name, runs_kernels=True) -> CpuKind`: for the rest of the test, this machine is a CPU of kind
    `name` (`workers.engine.cpu_kind.KINDS`) to every decision the code makes (its flags, bf16, AMX, what dtype auto
    means, the linear weights, the few-token kernel, the fused layer op), all read through `cpu_kind.this_cpu()`.

    The kernels still run on the real CPU, from its own build: with `runs_kernels`, where the kind has instructions
    this machine lacks, the test is skipped and says which ("needs amx_tile amx_bf16"). A kind whose instructions
    this machine has runs the build's code for this machine (an AVX2 kind's widening linear, on an AVX-512
    machine, runs its portable loop; `tests/engine/test_cpu_kind.py` runs the AVX2 lanes from a build of their own)."""
    from workers.engine import cpu_kind

    real = cpu_kind.this_cpu()

    def fake(name: str, runs_kernels: bool = True):
        kind = cpu_kind.KINDS[name]
        missing = real.missing_for(kind)
        if runs_kernels and missing:
            pytest.skip(f"needs {' '.join(missing)}: the kernels of a CPU of kind {name} cannot run on this "
                        f"{real.name} CPU")
        monkeypatch.setattr(cpu_kind, "this_cpu", lambda: kind)
        return kind

    return fake


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real prompts and traces, read in place (never copied into the project)."""
    if not SHARED_DATA.is_dir():
        pytest.fail(f"{SHARED_DATA} is missing: tests read real data from ../shared/data")
    return SHARED_DATA


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    """Converted models survive between runs here (gitignored), so conversion happens once."""
    return REPO_ROOT / ".cache" / "models"


@pytest.fixture(scope="session")
def smollm2_dir(model_cache_dir: Path) -> Path:
    """The real SmolLM2-135M-Instruct as a local safetensors folder."""
    from workers.engine.models import DEFAULT_MODEL, resolve_model_dir

    return resolve_model_dir(DEFAULT_MODEL, model_cache_dir)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path):
    from workers.engine.models import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture
def prefill_logits():
    """`prefill_logits(engine, prompt)`: logits of every prompt position from one fast-path prefill step.

    The engine samples from the last position only; this keeps the logits of all rows
    ([len(prompt), vocab], float32) so tests can compare them with a Hugging Face forward.
    """
    import torch

    from workers.values.sampling_params import SamplingParams

    def run(engine, prompt: list[int]) -> torch.Tensor:
        assert engine.runner.path == "fast"
        captured = {}
        forward = engine.runner.fast.forward

        def keep_all_rows(ids, positions, attention, rows, step=None):
            captured["logits"], hidden = forward(ids, positions, attention, torch.arange(ids.shape[0]), step)
            return captured["logits"][rows], hidden[rows]

        engine.runner.fast.forward = keep_all_rows
        try:
            engine.add_request(list(prompt), SamplingParams(max_tokens=1))
            engine.step()
        finally:
            engine.runner.fast.forward = forward
        return captured["logits"].float()

    return run


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real embedded redis-server, one per test module (`cluster.control.redis_server.EmbeddedRedis`)."""
    from cluster.control.redis_server import EmbeddedRedis

    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as embedded:
        yield embedded


@pytest.fixture(scope="module")
def tiny_model():
    """The tiny random Llama at std 0.2 (`engine_driver.make_model`); engines get deep copies, it never runs."""
    from engine_driver import make_model

    return make_model(seed=0)


@pytest.fixture(scope="module")
def hf_greedy(tiny_model):
    """HF greedy `generate` on the module's `tiny_model` (`engine_driver.hf_greedy_runner`)."""
    from engine_driver import hf_greedy_runner

    return hf_greedy_runner(tiny_model)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny-model tests: the matmuls are too small to split; on a busy machine extra threads only spin.

    Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`.
    """
    import torch

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture
def synthetic_probe_features():
    """`make(num_prompts, hidden_size, seed)`: probe rows (`HiddenFeatures`) at 0, 64 and 128 decoded tokens whose
    hidden state carries log(1 + remaining tokens) along a fixed direction, plus unit noise; ids "set:<n>"."""
    import numpy as np

    from predictor_service.hidden_features import HiddenFeatures

    def make(num_prompts: int, hidden_size: int, seed: int) -> HiddenFeatures:
        rng = np.random.default_rng(seed)
        direction = np.random.default_rng(99).normal(size=hidden_size)
        direction /= np.linalg.norm(direction)
        totals = rng.integers(2, 400, size=num_prompts)
        rows = [(p, n) for p in range(num_prompts) for n in (0, 64, 128) if n < totals[p]]
        prompt = np.array([p for p, _ in rows])
        decoded = np.array([n for _, n in rows], dtype=np.int64)
        remaining = totals[prompt] - decoded
        hidden = rng.normal(size=(len(rows), hidden_size)) + 5 * np.log1p(remaining)[:, None] * direction
        return HiddenFeatures(np.array([f"set:{p}" for p in prompt]), np.full(len(rows), 20, dtype=np.int64),
                              decoded, np.full(len(rows), 500, dtype=np.int64), totals[prompt].astype(np.int64),
                              hidden.astype(np.float16), {"max_len": 520})

    return make
