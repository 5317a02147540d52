"""What `deepspeed.init_inference` does to the model, on DeepSpeed's CPU accelerator.

With one rank (what a worker runs today) it wraps without replacing a module: no kernel
injection, our paged attention stays in charge, and the logits are bit-identical. With two
ranks over gloo (the tensor parallelism the design describes) AutoTP shards each decoder
layer's linear layers across the ranks and the logits still match the unsharded model.
"""

import copy
import multiprocessing

import pytest
import torch

from workers.actors.ports import free_port
from workers.engine.model_runner import wrap_with_deepspeed
from workers.engine.models import make_tiny_model

PROMPT = [[5, 9, 3, 7, 11]]


def test_one_rank_wraps_without_replacing_a_module_and_computes_the_same():
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    model = make_tiny_model(seed=0, init_std=0.2)
    reference = copy.deepcopy(model)
    types_before = {name: type(module) for name, module in model.named_modules()}
    wrapped = wrap_with_deepspeed(model, tensor_parallel_size=1)
    assert get_accelerator().device_name() == "cpu"
    assert isinstance(wrapped, deepspeed.InferenceEngine) and wrapped.module is model
    assert {name: type(module) for name, module in wrapped.module.named_modules()} == types_before
    assert next(wrapped.module.parameters()).dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(wrapped(torch.tensor(PROMPT)).logits, reference(torch.tensor(PROMPT)).logits)


def _tensor_parallel_rank(rank: int, world_size: int, port: int, results) -> None:
    from workers.actors.rank_group import join_ranks

    torch.set_num_threads(1)
    join_ranks(rank, world_size, "127.0.0.1", port, "cpu")
    model = make_tiny_model(seed=0, init_std=0.2)
    reference = copy.deepcopy(model)
    wrapped = wrap_with_deepspeed(model, tensor_parallel_size=world_size)
    with torch.no_grad():
        error = float((wrapped(torch.tensor(PROMPT)).logits - reference(torch.tensor(PROMPT)).logits).abs().max())
    shapes = {name.removeprefix("model.layers.0."): tuple(p.shape)
              for name, p in wrapped.module.named_parameters() if name.startswith("model.layers.0.")}
    kinds = {name.removeprefix("model.layers.0."): type(m).__name__
             for name, m in wrapped.module.named_modules() if name.startswith("model.layers.0.")}
    results.put((rank, error, shapes, kinds))


@pytest.mark.slow
def test_two_ranks_over_gloo_shard_every_decoder_linear_and_match_the_unsharded_logits():
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_tensor_parallel_rank, args=(rank, 2, port, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        answers = sorted(results.get(timeout=600) for _ in ranks)
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    full = {name.removeprefix("model.layers.0."): tuple(p.shape)
            for name, p in make_tiny_model(seed=0).named_parameters() if name.startswith("model.layers.0.")}
    for rank, error, shapes, kinds in answers:
        assert error < 1e-4, (rank, error)
        for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "mlp.gate_proj.weight", "mlp.up_proj.weight"):  # output features split across ranks
            assert shapes[name] == (full[name][0] // 2, full[name][1]), name
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):  # input features split, then all-reduced
            assert shapes[name] == (full[name][0], full[name][1] // 2), name
        assert kinds["self_attn.o_proj"] == kinds["mlp.down_proj"] == "LinearAllreduce"
