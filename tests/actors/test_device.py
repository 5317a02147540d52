"""Device plumbing: which device a worker picks and how much KV it gets, decided on CPU for every case."""

import pytest

from cluster.config import ServiceConfig
from workers.engine.device import cgroup_room_bytes, check_device, free_memory_bytes, resolve_device


def test_auto_takes_the_gpu_ray_gave_the_actor_and_the_cpu_otherwise():
    assert resolve_device("auto", cuda_available=True, assigned_gpu_ids=["0"]) == "cuda"
    assert resolve_device("auto", cuda_available=True, assigned_gpu_ids=None) == "cuda"  # outside Ray
    assert resolve_device("auto", cuda_available=True, assigned_gpu_ids=[]) == "cpu"  # asked Ray for no GPU
    assert resolve_device("auto", cuda_available=False, assigned_gpu_ids=["0"]) == "cpu"
    assert resolve_device("cpu", cuda_available=True, assigned_gpu_ids=["0"]) == "cpu"
    assert resolve_device("cuda:1", cuda_available=True, assigned_gpu_ids=None) == "cuda:1"


def test_cuda_without_cuda_and_bad_names_are_refused_clearly():
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda", cuda_available=False, assigned_gpu_ids=None)
    for bad in ("gpu", "cuda:x", "", "CPU"):
        with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
            check_device(bad)


def test_free_memory_on_the_cpu_is_what_the_machine_has_available_within_the_cgroup(tmp_path):
    import psutil

    free = free_memory_bytes("cpu")
    assert 0 < free <= psutil.virtual_memory().total
    (tmp_path / "memory.max").write_text("1000000\n")
    (tmp_path / "memory.current").write_text("400000\n")
    assert cgroup_room_bytes(tmp_path) == 600000
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_room_bytes(tmp_path) is None
    assert cgroup_room_bytes(tmp_path / "missing") is None


def test_device_settings_travel_from_the_service_config_to_the_worker_settings():
    from cluster.control.controller import worker_settings

    assert worker_settings(ServiceConfig()).device == "auto"
    gpu = worker_settings(ServiceConfig(device="cuda", kv_cache_memory="0.9", worker_num_gpus=1))
    assert (gpu.device, gpu.kv_cache_memory) == ("cuda", "0.9")
    assert worker_settings(ServiceConfig()).kv_cache_memory == "auto"
    assert worker_settings(ServiceConfig(kv_cache_memory=268435456)).kv_cache_memory == "268435456"  # YAML int
    with pytest.raises(ValueError, match="device must be"):
        ServiceConfig(device="tpu")
    assert worker_settings(ServiceConfig()).engine.tensor_parallel_size == 1
    assert worker_settings(ServiceConfig(tensor_parallel_size=2, worker_num_gpus=1)).engine.tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ServiceConfig(tensor_parallel_size=0)
    assert worker_settings(ServiceConfig()).rank_stall_s == 300.0
    assert worker_settings(ServiceConfig(rank_stall_s=30)).rank_stall_s == 30.0
    with pytest.raises(ValueError, match="rank_stall_s"):
        ServiceConfig(rank_stall_s=0)


def test_a_tensor_parallel_worker_needs_its_placement_group():
    from workers.actors.rank_group import start_ranks
    from workers.actors.worker_settings import WorkerSettings

    with pytest.raises(ValueError, match="needs a placement group of 2 bundles"):
        start_ranks(WorkerSettings.of(tensor_parallel_size=2), None, load_model=None)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        WorkerSettings.of(tensor_parallel_size=0)


def test_a_worker_engine_built_for_the_cpu_runs_there():
    from workers.actors.worker_actor import build_engine
    from workers.actors.worker_settings import WorkerSettings
    from workers.values.sampling_params import SamplingParams

    engine = build_engine(WorkerSettings.of(tiny_model_seed=0, device="cpu", dtype="float32",
                                         kv_cache_memory="64KiB", block_size=4, max_model_len=64))
    assert engine.runner.device.type == "cpu"
    assert engine.allocator.num_blocks == 32  # 64 KiB / (2 layers x K,V x 4 tokens x 2 heads x 16 x 4 bytes)
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0]) == 3


def test_a_cpu_worker_sizes_its_kv_from_the_memory_available():
    """auto: room for max_num_seqs whole sequences (the tiny model's few bytes per token never reach the 10% cap);
    a share: that share of the memory available once the model is loaded."""
    from workers.actors.worker_actor import build_engine
    from workers.actors.worker_settings import WorkerSettings

    auto = build_engine(WorkerSettings.of(tiny_model_seed=0, device="cpu", dtype="float32", block_size=4,
                                       max_model_len=64, max_num_seqs=8))
    assert auto.allocator.num_blocks * 4 == 8 * 64
    tiny_share = 1e-6  # of the free memory: a few KiB, not a real budget
    shared = build_engine(WorkerSettings.of(tiny_model_seed=0, device="cpu", dtype="float32", block_size=4,
                                         max_model_len=64, kv_cache_memory=f"{tiny_share:.6f}"))
    expected_blocks = free_memory_bytes("cpu") * tiny_share // shared.runner.pool_shape.bytes_per_block
    assert shared.allocator.num_blocks == pytest.approx(expected_blocks, rel=0.2)
