"""Device plumbing: which device a worker picks and how much KV it gets, decided on CPU for every case."""

import pytest

from cluster.config import ServiceConfig
from workers.device import check_device, kv_budget_bytes, resolve_device


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


def test_the_kv_budget_is_bytes_or_a_share_of_free_gpu_memory():
    assert kv_budget_bytes(1000, None, "cpu", None) == 1000
    assert kv_budget_bytes(1000, 0.5, "cuda", 80 * 1024**3) == 40 * 1024**3
    with pytest.raises(ValueError, match="give kv_cache_bytes instead"):
        kv_budget_bytes(1000, 0.5, "cpu", None)
    with pytest.raises(ValueError, match=r"kv_cache_fraction must be in \(0, 1\]"):
        kv_budget_bytes(1000, 1.5, "cuda", 10)


def test_device_settings_travel_from_the_service_config_to_the_worker_settings():
    from cluster.control.controller import worker_settings

    assert worker_settings(ServiceConfig()).device == "auto"
    gpu = worker_settings(ServiceConfig(device="cuda", kv_cache_fraction=0.9, worker_num_gpus=1))
    assert (gpu.device, gpu.kv_cache_fraction) == ("cuda", 0.9)
    with pytest.raises(ValueError, match="device must be"):
        ServiceConfig(device="tpu")
    assert worker_settings(ServiceConfig()).tensor_parallel_size == 1
    assert worker_settings(ServiceConfig(tensor_parallel_size=2, worker_num_gpus=1)).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ServiceConfig(tensor_parallel_size=0)
    assert worker_settings(ServiceConfig()).rank_stall_s == 300.0
    assert worker_settings(ServiceConfig(rank_stall_s=30)).rank_stall_s == 30.0
    with pytest.raises(ValueError, match="rank_stall_s"):
        ServiceConfig(rank_stall_s=0)


def test_a_tensor_parallel_worker_needs_its_placement_group():
    from workers.rank_group import start_ranks
    from workers.worker_actor import WorkerSettings

    with pytest.raises(ValueError, match="needs a placement group of 2 bundles"):
        start_ranks(WorkerSettings(tensor_parallel_size=2), None)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        WorkerSettings(tensor_parallel_size=0)


def test_a_worker_engine_built_for_the_cpu_runs_there():
    from workers.sampling_params import SamplingParams
    from workers.worker_actor import WorkerSettings, build_engine

    engine = build_engine(WorkerSettings(tiny_model_seed=0, device="cpu", dtype="float32",
                                         kv_cache_bytes=64 * 1024, block_size=4, max_model_len=64))
    assert engine.runner.device.type == "cpu"
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0]) == 3
    with pytest.raises(ValueError, match="give kv_cache_bytes instead"):
        build_engine(WorkerSettings(tiny_model_seed=0, device="cpu", kv_cache_fraction=0.5))
