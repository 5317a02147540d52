"""The CPU kernels' build: every source compiled (side by side) and linked into one library, a failed compile
named in one line, and a build cached under its key."""

import ctypes

import pytest

from kv_kernels import cpu_build


@pytest.fixture
def two_sources(tmp_path, monkeypatch):
    """Two small C++ sources in place of the kernels (no torch headers: a fast compile)."""
    first, second = tmp_path / "first.cpp", tmp_path / "second.cpp"
    first.write_text('extern "C" int first_answer() { return 41; }\n')
    second.write_text('extern "C" int second_answer() { return 42; }\n')
    monkeypatch.setattr(cpu_build, "SOURCES", (first, second))
    monkeypatch.setattr(cpu_build, "HEADERS", ())
    return first, second


def test_every_source_is_compiled_and_linked_into_one_cached_library(tmp_path, two_sources):
    path = cpu_build.build(tmp_path / "cache", quiet=True)
    library = ctypes.CDLL(str(path))
    assert (library.first_answer(), library.second_answer()) == (41, 42)
    assert cpu_build.build(tmp_path / "cache", quiet=True) == path  # cached: the same file, no rebuild
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.suffix == ".so"] == [path.name]  # no objects left


def test_a_source_that_does_not_compile_is_named_in_one_line(tmp_path, two_sources):
    two_sources[1].write_text('extern "C" int second_answer() { return undeclared_name; }\n')
    with pytest.raises(RuntimeError, match=r"building .* failed \(.* exit 1\): .*error.*undeclared_name"):
        cpu_build.build(tmp_path / "cache", quiet=True)
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-built is left to load
