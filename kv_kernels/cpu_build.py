"""Build and load the C++ CPU kernels (`kv_kernels/csrc/*.cpp`) as `torch.ops.s3_cpu.*`.

One compiler call per source file against torch's headers (as many at once as there are
cores), then one link against torch's libraries (no ninja, no pybind), tuned for the
machine it runs on (`-march=native`). The shared library is cached
under a key of everything that changes the binary, so a changed source, torch,
compiler or CPU builds afresh and nothing else does:

    <cache_dir>/s3_cpu-<key>.so        key = sha256(sources, flags, torch version, gcc -v, CPU flags)
    <cache_dir>/s3_cpu-<key>.so.lock   held while building

`make setup` builds it (`python -m kv_kernels.cpu_build`); a process that finds no
build makes one on first use (1-2 minutes on 2 cores) and says so.
"""

import hashlib
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from filelock import FileLock

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "paged_attention.cpp", CSRC / "layer_ops.cpp", CSRC / "token_mask.cpp", CSRC / "linear_ops.cpp",
           CSRC / "amx_linear.cpp", CSRC / "row_argmax.cpp", CSRC / "bf16_weight_linear.cpp",
           CSRC / "decoder_layer.cpp")
HEADERS = (CSRC / "vector_math.h",)
# -fopenmp: at::parallel_for is an inline OpenMP loop, so it runs serially unless this file is
# compiled with OpenMP; linking against torch's own libgomp (searched first, see -L below)
# keeps one OpenMP runtime and one thread pool in the process.
FLAGS = ("-O3", "-ffp-contract=fast", "-fno-math-errno", "-fopenmp", "-std=c++17", "-fPIC",
         "-DNDEBUG", "-w")
OPS = ("append_kv", "paged_attention", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul",
       "mask_disallowed_", "small_linear", "small_linear_native",
       "amx_linear", "amx_linear_native", "row_argmax", "bf16_weight_linear", "bf16_weight_linear_native",
       "decoder_layer")


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "s3serve" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _build_key(march: str) -> str:
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    digest.update(" ".join((*FLAGS, f"-march={march}")).encode())
    digest.update(torch.__version__.encode())
    digest.update(_cpu_flags().encode())
    try:
        version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, check=False).stdout
    except OSError:
        version = "no compiler"
    digest.update(version.encode())
    return digest.hexdigest()[:16]


def _compile_commands(build_dir: Path, out_path: Path, march: str) -> tuple[list[list[str]], list[str]]:
    """One `-c` command per source (objects in build_dir), and the link of those objects into out_path."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    lib_dirs = cpp_extension.library_paths()
    objects = [build_dir / f"{source.stem}.o" for source in SOURCES]
    compiles = [[_compiler(), *FLAGS, f"-march={march}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, "-c",
                 str(source), "-o", str(obj)] for source, obj in zip(SOURCES, objects)]
    link = [_compiler(), "-shared", "-fopenmp", *map(str, objects), "-o", str(out_path),
            *[f"-L{d}" for d in lib_dirs], *[f"-Wl,-rpath,{d}" for d in lib_dirs], "-lc10", "-ltorch_cpu", "-lgomp"]
    return compiles, link


def _run_compiler(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or ["no output"]
        first_error = next((line for line in lines if "error" in line), lines[-1])
        raise RuntimeError(f"building {CSRC} failed ({_compiler()} exit {result.returncode}): {first_error.strip()}")


def _compile(build_dir: Path, out_path: Path, march: str) -> None:
    """Compiles the sources side by side (one per core), then links them."""
    compiles, link = _compile_commands(build_dir, out_path, march)
    with ThreadPoolExecutor(max_workers=max(1, min(len(compiles), os.cpu_count() or 1))) as pool:
        list(pool.map(_run_compiler, compiles))
    _run_compiler(link)


def library_path(cache_dir: Path | None = None, march: str = "native") -> Path:
    """Where the library for this source, torch, compiler, CPU and `march` lives (built or not)."""
    return Path(cache_dir or default_cache_dir()) / f"s3_cpu-{_build_key(march)}.so"


def build(cache_dir: Path | None = None, quiet: bool = False, march: str = "native") -> Path:
    """Compile the library unless a matching build exists; returns its path. Race-safe across processes.

    The engine loads the library built for this machine (`march` native). One built for another x86 level
    (`march` x86-64-v3: AVX2 and FMA, no AVX-512) lets a test run another CPU kind's code paths on a machine whose
    instructions include that kind's (`pytest --cpu-kind`, in a process of its own: the ops share one namespace)."""
    path = library_path(cache_dir, march)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            return path
        if not quiet:
            print(f"building the CPU kernels once ({CSRC} -> {path}); 1-2 minutes on 2 cores", file=sys.stderr,
                  flush=True)
        start_s = time.monotonic()
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            tmp_path = Path(tmp) / path.name
            _compile(Path(tmp), tmp_path, march)
            os.replace(tmp_path, path)
        if not quiet:
            print(f"built the CPU kernels in {time.monotonic() - start_s:.0f} s", file=sys.stderr, flush=True)
    return path


def is_loaded() -> bool:
    """True when `torch.ops.s3_cpu` holds every op of this library."""
    try:
        return all(hasattr(torch.ops.s3_cpu, op) for op in OPS)
    except (AttributeError, RuntimeError):
        return False


def load(cache_dir: Path | None = None) -> None:
    """Build if needed, then register `torch.ops.s3_cpu.*` in this process (idempotent).

    Raises RuntimeError with the compiler's last line when the build fails.
    """
    if is_loaded():
        return
    torch.ops.load_library(str(build(cache_dir)))


def native_kernels() -> tuple[str, ...]:
    """The kernels the library (loaded, or built and loaded now) runs natively on this CPU (each `<name>_native`
    op that answers True)."""
    load()
    return tuple(op.removesuffix("_native") for op in OPS if op.endswith("_native") and getattr(torch.ops.s3_cpu, op)())


def main() -> int:
    start_s = time.monotonic()
    try:
        load()
    except (RuntimeError, OSError) as error:
        print(f"kv_kernels.cpu_build: error: {error}", file=sys.stderr)
        print("hint: the engine falls back to the slower torch reference kernels without this build",
              file=sys.stderr)
        return 1
    print(f"CPU kernels ready ({library_path()}, {time.monotonic() - start_s:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
