"""Runs one ragged forward over paged KV: the fast path on CPU and CUDA, a DeepSpeed-wrapped HF model otherwise.

Per step, `run()` builds the attention metadata once (validated once, on the
host, before any tensor reaches the device), then runs one forward in which
each layer calls the backend's `attention()` with it: no per-layer checks, no
per-layer `.tolist()`, no host syncs inside the forward.

Which forward runs (`path`):
- "fast": `FastDecoder` (a model of its `ARCHITECTURES`; on CPU with the C++ kernels: fused
  ops, oneDNN-packed bf16 weights; on CUDA with torch's ops, the Triton
  attention and concatenated projections). DeepSpeed is not involved: with
  tensor_parallel_size 1 and no kernel injection its wrapper changes nothing but
  adds a call layer.
- "hf": the Hugging Face module stack wrapped by `deepspeed.init_inference`
  (tensor parallel on CUDA), our attention plugged in through `AttentionInterface`.
"""

import time
from dataclasses import dataclass

import torch

from kv_kernels import BlockPoolShape, CpuKVKernels, KVKernelBackend, allocate_block_pool, build_attention_metadata
from workers.engine.attention import StepAttention, register_paged_attention
from workers.engine.logprobs import PromptScores, scored_positions, split_scores
from workers.scheduling.scheduler_output import ScheduledChunk
from workers.values.model_support import check_servable
from workers.values.sequence import Sequence


def pool_shape_for(model_config, num_blocks: int, block_size: int, dtype: torch.dtype,
                   tensor_parallel_size: int = 1) -> BlockPoolShape:
    """Block-pool geometry of a Hugging Face decoder config, for one of `tensor_parallel_size` ranks
    (each holds 1/tp of the KV heads). Raises ValueError when the heads do not split evenly."""
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    check_tensor_parallel(model_config, tensor_parallel_size)
    return BlockPoolShape(
        num_layers=model_config.num_hidden_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=model_config.num_key_value_heads // tensor_parallel_size,
        head_dim=head_dim,
        dtype=dtype,
    )


def check_tensor_parallel(model_config, tensor_parallel_size: int) -> None:
    """Raise ValueError unless the attention and KV heads split evenly across the ranks."""
    heads, kv_heads = model_config.num_attention_heads, model_config.num_key_value_heads
    if tensor_parallel_size < 1 or heads % tensor_parallel_size or kv_heads % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} must divide the model's {heads} attention "
                         f"heads and {kv_heads} KV heads")


@dataclass(frozen=True, slots=True)
class ForwardInputs:
    """One step's forward in plain host values (what tensor-parallel ranks are sent).

    Tokens are packed prefill chunks first (longest first), then decodes; `sample_rows` are the
    packed rows whose logits the step samples from, `score_rows` the prompt rows it scores
    (`workers.engine.logprobs`), whose logits follow the sampled ones.
    """

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]
    query_lens: list[int]
    seq_lens: list[int]
    num_prefills: int
    sample_rows: list[int]
    score_rows: tuple[int, ...] = ()


def wrap_with_deepspeed(model: torch.nn.Module, tensor_parallel_size: int) -> torch.nn.Module:
    """`deepspeed.init_inference` without kernel injection: our attention stays in charge.

    With tensor_parallel_size 1 no module is replaced. Above 1, torch.distributed must already
    run that many ranks (nccl on CUDA, gloo on CPU: `tests/engine/test_deepspeed_wrapping.py` runs two),
    and AutoTP shards every decoder linear layer across them; `workers.engine.tensor_parallel` runs one
    engine over those ranks.
    """
    import deepspeed

    return deepspeed.init_inference(
        model,
        tensor_parallel={"tp_size": tensor_parallel_size},
        dtype=model.dtype,
        replace_with_kernel_inject=False,
    )


@dataclass(slots=True)
class ForwardTimes:
    """Where the latest `run()` spent its time, in seconds (CPU: exact; CUDA: launch time only)."""

    prepare_s: float = 0.0  # metadata and inputs
    forward_s: float = 0.0  # the whole forward, attention included
    attention_s: float = 0.0  # inside the backend's attention


class ModelRunner:
    """Owns the model and the KV block pool; turns scheduled chunks into logits.

    Args:
        model: a Hugging Face causal LM, eval mode, on its device.
        num_blocks, block_size: pool geometry (the allocator's).
        backend: KV kernels for the model's device.
        tensor_parallel_size: passed to DeepSpeed (HF path).
        max_model_len: longest sequence (sizes the fast path's rotary table).
        use_fast_path: take the fast path when the model and backend allow it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        backend: KVKernelBackend,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        use_fast_path: bool = True,
    ) -> None:
        from workers.engine.fast_decoder import FastDecoder, unsupported_reason

        check_servable(model.config, getattr(model.config, "_name_or_path", "") or model.config.model_type)
        self.device = next(model.parameters()).device
        self.backend = backend
        self.block_size = block_size
        self.tensor_parallel_size = tensor_parallel_size
        # This rank's share: 1/tp of the KV heads (AutoTP splits k_proj and v_proj by head).
        self.pool_shape = pool_shape_for(model.config, num_blocks, block_size, model.dtype, tensor_parallel_size)
        self.kv_caches = allocate_block_pool(self.pool_shape, self.device)
        if not use_fast_path:
            self.fast_path_off_reason = "turned off"
        elif tensor_parallel_size > 1:
            self.fast_path_off_reason = "tensor parallel runs the Hugging Face stack under DeepSpeed AutoTP"
        elif self.device.type == "cpu" and not isinstance(backend, CpuKVKernels):
            self.fast_path_off_reason = f"the {backend.name} backend has no fused ops (needs the C++ CPU kernels)"
        else:
            self.fast_path_off_reason = unsupported_reason(model)
        self.fast = None
        if self.fast_path_off_reason is None:
            self.fast = FastDecoder(model, max_model_len or model.config.max_position_embeddings)
            self.model = model
        else:
            model.set_attn_implementation(register_paged_attention())
            self.model = wrap_with_deepspeed(model, tensor_parallel_size)
        self.last_times = ForwardTimes()
        # seq_id -> per layer (k_blocks, v_blocks), each [num_blocks, block_size, kv_heads, head_dim] on the host
        self._swapped: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def path(self) -> str:
        return "fast" if self.fast is not None else "hf"

    # -- swap ---------------------------------------------------------------

    def swap_out(self, seq_id: str, block_ids: list[int]) -> int:
        """Copy a preempted sequence's blocks to host memory; returns the bytes moved."""
        self._swapped[seq_id] = self.copy_to_host(block_ids)
        return len(block_ids) * self.pool_shape.bytes_per_block

    def copy_to_host(self, block_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k_blocks, v_blocks) host copies of `block_ids`, each [n, block_size, kv_heads, head_dim]."""
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        host_shape = (len(block_ids), *self.pool_shape.layer_shape()[1:])
        pin = self.device.type == "cuda"
        saved = []
        for k_cache, v_cache in self.kv_caches:
            k_host = torch.empty(host_shape, dtype=k_cache.dtype, pin_memory=pin)
            v_host = torch.empty(host_shape, dtype=v_cache.dtype, pin_memory=pin)
            self.backend.swap_out(k_cache, ids, k_host)
            self.backend.swap_out(v_cache, ids, v_host)
            saved.append((k_host, v_host))
        return saved

    def wait_for_device(self) -> None:
        """Return once the device has run what was queued on it (on CUDA, kernels and copies into pinned host
        memory are asynchronous; on CPU everything already ran)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def transfer_shape(self) -> BlockPoolShape:
        """The pool as a moved request's KV sees it (`LeadRunner` joins the ranks' heads; one rank has them all)."""
        return self.pool_shape

    def swapped_copy(self, seq_id: str) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The host blocks of a swapped-out sequence (not a copy), or None."""
        return self._swapped.get(seq_id)

    def import_swapped(self, seq_id: str, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Take host blocks from elsewhere (another worker) as `seq_id`'s swap copy; swap-in copies them in."""
        self._swapped[seq_id] = list(layers)

    def swap_in(self, seq_id: str, block_ids: list[int]) -> int:
        """Copy a sequence's host blocks into its newly allocated blocks; returns the bytes moved."""
        saved = self._swapped.pop(seq_id)
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for (k_cache, v_cache), (k_host, v_host) in zip(self.kv_caches, saved):
            self.backend.swap_in(k_cache, ids, k_host)
            self.backend.swap_in(v_cache, ids, v_host)
        return len(block_ids) * self.pool_shape.bytes_per_block

    def drop_swapped(self, seq_id: str) -> None:
        """Forget host blocks of a sequence that will not come back (aborted)."""
        self._swapped.pop(seq_id, None)

    # -- forward ------------------------------------------------------------

    def run(self, chunks: list[ScheduledChunk], want_hidden: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None, list[ScheduledChunk], PromptScores | None]:
        """Forward the chunks; return logits [num_sampling, vocab], the final-norm hidden states of the same rows
        [num_sampling, hidden] (model dtype), the chunks they belong to and the prompt rows scored (None: none).

        The fast path returns the hidden rows always (they are the lm_head's input); the HF path
        only with `want_hidden` (it then keeps every layer's states for the step), else None.
        """
        start_s = time.perf_counter()
        inputs, sampling_chunks, spans = self.prepare(chunks)
        packed_s = time.perf_counter() - start_s
        logits, hidden = self.forward(inputs, want_hidden)
        self.last_times.prepare_s += packed_s  # forward() timed building the tensors and metadata
        return split_scores(logits, hidden, sampling_chunks, spans)

    def prepare(self, chunks: list[ScheduledChunk]
                ) -> tuple[ForwardInputs, list[ScheduledChunk], list[tuple[Sequence, int, int]]]:
        """Pack the chunks into one forward's inputs; also the chunks that sample, in their rows' order, and the
        prompt spans scored (`PromptScores.spans`)."""
        # Prefill chunks first, longest first (backends may route the longest to GEMM attention), then decodes.
        prefills = sorted((c for c in chunks if c.num_tokens > 1), key=lambda c: c.num_tokens, reverse=True)
        ordered = prefills + [c for c in chunks if c.num_tokens == 1]
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sampling_chunks: list[ScheduledChunk] = []
        score_rows: list[int] = []
        spans: list[tuple[Sequence, int, int]] = []
        for chunk in ordered:
            seq = chunk.seq
            start = seq.num_computed_tokens
            end = start + chunk.num_tokens
            scored = scored_positions(seq, start, end)
            if scored:
                score_rows.extend(len(input_ids) + p - start for p in scored)
                spans.append((seq, scored.start, len(scored)))
            table = chunk.block_table
            if chunk.num_tokens == 1:
                input_ids.append(seq.token_at(start))
                positions.append(start)
                slots.append(table[start // block_size] * block_size + start % block_size)
            else:
                input_ids.extend(seq.tokens_between(start, end))
                positions.extend(range(start, end))
                slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            tables.append(table)
            query_lens.append(chunk.num_tokens)
            seq_lens.append(end)
            if chunk.completes_sequence_tokens:
                sample_rows.append(len(input_ids) - 1)
                sampling_chunks.append(chunk)
        inputs = ForwardInputs(input_ids, positions, slots, tables, query_lens, seq_lens, len(prefills), sample_rows,
                               tuple(score_rows))
        return inputs, sampling_chunks, spans

    @torch.inference_mode()
    def forward(self, inputs: ForwardInputs, want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over packed inputs: logits [len(sample_rows) + len(score_rows), vocab] and, on the fast path
        or with `want_hidden`, the final-norm hidden states of the sampled rows (else None)."""
        start_s = time.perf_counter()
        device = self.device
        meta = build_attention_metadata(inputs.query_lens, inputs.seq_lens, inputs.block_tables, inputs.slots,
                                        inputs.num_prefills, self.pool_shape, device)
        attention = StepAttention(self.kv_caches, self.backend, meta)
        # An all-partial-prefill step samples nothing; keep one row so
        # logits_to_keep is never empty (an int 0 would mean "keep all").
        rows = [*inputs.sample_rows, *inputs.score_rows] or [len(inputs.input_ids) - 1]
        keep = torch.tensor(rows, dtype=torch.long, device=device)
        ids = torch.tensor(inputs.input_ids, dtype=torch.long, device=device)
        pos = torch.tensor(inputs.positions, dtype=torch.long, device=device)
        forward_start_s = time.perf_counter()
        if self.fast is not None:
            scale = self.fast.scale
            logits, hidden = self.fast.forward(ids, pos, lambda i, q, k, v, w: attention(i, q, k, v, scale, w),
                                              keep, attention)
        else:
            outputs = self.model(input_ids=ids[None], position_ids=pos[None], logits_to_keep=keep, use_cache=False,
                                 s3_attention=attention, output_hidden_states=want_hidden)
            logits = outputs.logits[0]
            # the last of the hidden states is the final norm's output, the lm_head's input
            hidden = outputs.hidden_states[-1][0].index_select(0, keep) if want_hidden else None
        end_s = time.perf_counter()
        self.last_times = ForwardTimes(forward_start_s - start_s, end_s - forward_start_s, attention.elapsed_s)
        num_sampling = len(inputs.sample_rows)
        return logits[:num_sampling + len(inputs.score_rows)], None if hidden is None else hidden[:num_sampling]
