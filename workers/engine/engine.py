"""The engine: continuous batching over a paged KV cache.

One `step()` = schedule() -> run() -> postprocess(): the scheduler picks token
chunks (decodes plus prefill chunks within a token budget), the model runner
does one ragged forward over all of them, the sampler picks the next token of
every sequence whose known tokens are now all cached, and finished sequences
give their blocks back.
"""

import itertools
import logging
import time

import torch

from kv_kernels import KVKernelBackend, backend_for_device
from workers.engine.clock import EngineClock
from workers.engine.grammar_masks import CPU_OVERLAP_MAX_ROWS, GrammarMasks
from workers.engine.kv_transfer import ExportedKV
from workers.engine.logprobs import record_prompt_scores, sampled_logprobs, score_prompts, take_prompt_logprobs
from workers.engine.model_runner import ModelRunner, pool_shape_for
from workers.engine.reprobe import reprobe
from workers.engine.sampling import Sampler
from workers.engine.tensor_parallel import LeadRunner, check_ranks, send_config
from workers.scheduling.engine_config import EngineConfig
from workers.scheduling.kv_cache_manager import BlockAllocator
from workers.scheduling.length_probe import LengthProbe
from workers.scheduling.preemption import PreemptionRule
from workers.scheduling.repetition import LOOP_CHECK_EVERY, flag_loop
from workers.scheduling.request_checks import check_plan, check_request
from workers.scheduling.scheduler import Scheduler
from workers.scheduling.scheduling_policy import SchedulingPolicy
from workers.values.sampling_params import SamplingParams
from workers.values.sequence import Sequence, SequenceStatus
from workers.values.step_output import RequestMetrics, StepOutput, StepShape, StepTimes, TokenLogprob, step_shape

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "RequestMetrics", "StepOutput", "StepTimes"]


class Engine:
    """Continuous-batching generation over a Hugging Face causal LM.

    Args:
        model: causal LM in eval mode, on its target device.
        config: engine settings.
        tokenizer: needed for stop strings and structured output (grammars are matched on its tokens).
        backend: KV kernels; chosen from the model's device when None.
        policy: admission, reservation and preemption rules; on-demand paging when None.
        probe: re-bounds each sequence's output length from its hidden state (see
            `workers.scheduling.length_probe`); the bound given with the request stays when None. Only policies
            that plan by a refinable prediction (`reads_prediction`: s3, s3_peak) get it; under the
            others it is not run.
        clock: what time is read from (`workers.engine.clock`); the wall clock when None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        tokenizer=None,
        backend: KVKernelBackend | None = None,
        policy: SchedulingPolicy | None = None,
        probe: LengthProbe | None = None,
        clock: EngineClock | None = None,
    ) -> None:
        self.config = config
        self.clock = clock or EngineClock()  # the wall clock; a bench may model time instead
        self.tokenizer = tokenizer
        device = next(model.parameters()).device
        model_config = model.config
        self.vocab_size = model_config.vocab_size
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        if self.max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{model_config.max_position_embeddings}"
            )
        tensor_parallel_size = config.tensor_parallel_size
        if tensor_parallel_size > 1:
            check_ranks(tensor_parallel_size)  # before DeepSpeed shards the model across them
        # Per rank: with tensor parallelism each rank's pool holds 1/tp of the KV heads in the same blocks.
        cache = config.cache
        bytes_per_block = pool_shape_for(model_config, 1, cache.block_size, model.dtype,
                                         tensor_parallel_size).bytes_per_block
        # Blocks are named by their tokens and the model: the KV of another model (or dtype) never matches.
        cache_salt = config.cache_salt or (
            f"{getattr(model_config, '_name_or_path', '')}:{model_config.model_type}:{model.dtype}")
        self.allocator = BlockAllocator.from_budget(config.kv_cache_bytes, bytes_per_block, cache.block_size,
                                                    cache.prefix_caching, cache_salt)
        preemption = PreemptionRule.for_budget(cache.preemption_mode, cache.swap_space_bytes, bytes_per_block,
                                               cache.block_size)
        self.scheduler = Scheduler(config.scheduler, self.allocator, policy, preemption)
        if tensor_parallel_size > 1:
            send_config(config, self.allocator.num_blocks)  # the followers build their runners alongside
        backend = backend or backend_for_device(device)
        runner = ModelRunner(
            model,
            self.allocator.num_blocks,
            cache.block_size,
            backend,
            tensor_parallel_size,
            max_model_len=self.max_model_len,
            use_fast_path=config.use_fast_path,
        )
        # Tensor parallel: the other ranks repeat every runner call (`workers.engine.tensor_parallel`).
        self.runner = LeadRunner(runner) if tensor_parallel_size > 1 else runner
        self.eos_token_ids = _eos_ids(model)
        self.sampler = Sampler(self.eos_token_ids, backend.row_argmax)
        self.grammars = GrammarMasks(tokenizer, self.vocab_size, self.eos_token_ids,  # structured output's matchers
                                     None if device.type == "cuda" else CPU_OVERLAP_MAX_ROWS)
        wanted = probe is not None and (self.scheduler.policy.reads_prediction or not probe.refines_bounds)
        self.probe = probe if wanted else None
        self.num_probe_reads = 0  # sequences the probe has read (prefill samples and re-predictions)
        self._sequences: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.swapped_bytes = 0  # KV bytes copied to and from the host by swaps, all steps together
        self.last_num_scheduled = 0  # sequences in the latest step's forward
        self.last_used_blocks = 0  # blocks holding computed KV after the latest step
        self.last_reserved_blocks = 0  # blocks reserved after the latest step
        self.last_times = StepTimes()
        self.last_shape = StepShape(0, 0, 0, 0)  # what the latest step computed (step-time calibration)

    def close(self) -> None:
        """Release the follower ranks of a tensor-parallel engine (it cannot step again); a no-op otherwise."""
        self.grammars.close()
        if isinstance(self.runner, LeadRunner):
            self.runner.close()

    # -- requests ---------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seq_id: str | None = None,
        predicted_output_tokens: int | None = None,
        arrival_s: float | None = None,
        resumed_output_token_ids: list[int] | None = None,
        kv: ExportedKV | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request; raise ValueError (changing nothing) if it can never be served.

        `predicted_output_tokens` is the length predictor's upper bound, used by
        length-aware policies; the worker never predicts by itself.
        `arrival_s` (seconds on the engine's clock) defaults to now; replay passes
        the scheduled arrival so queueing before this call counts in TTFT.
        `resumed_output_token_ids` are outputs generated elsewhere (a moved or
        re-placed request): they count as output tokens (max_tokens, forced
        lengths, stop strings) and generation continues after them. `kv` holds
        the KV of the first prompt + resumed tokens, exported by another engine;
        the sequence enters as if swapped out here, so admission copies it in
        instead of recomputing it (a tensor-parallel engine hands each rank its
        heads), unless it scores its prompt (`prompt_logprobs`) and has no output
        yet: then it needs the prompt's logits and recomputes. `priority` is the request's class: lower is more urgent
        (admitted first, preempted last; see `workers.scheduling.scheduler`).
        """
        seq_id = seq_id if seq_id is not None else f"seq-{next(self._ids)}"
        if seq_id in self._sequences:
            raise ValueError(f"request id {seq_id!r} is already in use")
        prompt, resumed = list(prompt_token_ids), list(resumed_output_token_ids or ())
        check_request(prompt, params, resumed, self.vocab_size, self.max_model_len, self.allocator,
                      self.config.kv_cache_bytes, has_tokenizer=self.tokenizer is not None)
        scores_prompt = params.prompt_logprobs is not None and not resumed  # else they were handed out already
        if scores_prompt:
            kv = None  # the prompt's logits are needed, not only its KV
        if kv is not None:
            kv.check_fits(self.runner.transfer_shape)
        check_plan(predicted_output_tokens, priority)
        seq = Sequence(
            seq_id=seq_id,
            priority=priority,
            prompt_token_ids=prompt,
            params=params,
            arrival_s=self.clock.now() if arrival_s is None else arrival_s,
            predicted_output_tokens=predicted_output_tokens,
            predicted_center_tokens=predicted_output_tokens,
            output_token_ids=resumed,
            prompt_logprobs=[] if scores_prompt else None,
        )
        # The policy's own needs (e.g. oracle wants the true length): fail here,
        # not inside a later step where it would stall every request.
        self.scheduler.policy.reservation_tokens(seq)
        if params.grammar is not None:
            self.grammars.add(seq_id, params.grammar, resumed)  # raises for a grammar it cannot compile
        if kv is not None:
            # At least the last known token must be computed here so that a step samples the next one;
            # KV of a token depends only on the tokens before it, so a prefix of the KV stays valid.
            kv = kv.truncated(min(kv.num_computed_tokens, seq.num_tokens - 1))
            if kv.num_computed_tokens > 0:
                try:
                    self.runner.import_swapped(seq_id, list(kv.layers))
                except Exception:
                    self.grammars.forget(seq_id)
                    raise
                seq.num_computed_tokens = kv.num_computed_tokens
                seq.is_swapped = True
        flag_loop(seq)  # a resumed answer (moved, re-placed) may repeat itself already
        self._sequences[seq_id] = seq
        self.scheduler.add(seq)
        return seq_id

    def abort(self, seq_id: str) -> bool:
        """Drop a request and free its blocks; False if it is unknown or already done."""
        if seq_id not in self._sequences:
            return False
        self.runner.drop_swapped(seq_id)  # first: with tensor parallelism it can fail, and nothing changed yet
        seq = self._sequences.pop(seq_id)
        self.scheduler.finish(seq)
        self.sampler.forget(seq_id)
        self.grammars.forget(seq_id)
        return True

    def export_sequence(self, seq_id: str) -> ExportedKV:
        """Host copy of a live sequence's computed KV (its swap copy if it is swapped out); changes nothing.

        A sequence whose KV was dropped (waiting to recompute) exports zero tokens. A tensor-parallel engine
        exports every rank's heads together (`LeadRunner.copy_to_host`), so any engine can take the copy.
        """
        seq = self._sequences.get(seq_id)
        if seq is None:
            raise ValueError(f"request id {seq_id!r} is unknown or already finished")
        block_size = self.config.cache.block_size
        if seq.is_swapped:
            layers = self.runner.swapped_copy(seq_id)
        elif seq.num_computed_tokens > 0 and self.allocator.has(seq_id):
            num_blocks = self.allocator.blocks_for(seq.num_computed_tokens)
            layers = self.runner.copy_to_host(self.allocator.block_table(seq_id)[:num_blocks])
            self.runner.wait_for_device()  # the copies into pinned memory are asynchronous
        else:
            return ExportedKV((), 0, block_size)
        return ExportedKV(tuple(layers), seq.num_computed_tokens, block_size)

    def used_blocks(self) -> int:
        """Blocks holding computed KV of running sequences (a block shared through the prefix cache counts once)."""
        per_sequence = sum(self.allocator.blocks_for(s.num_computed_tokens) for s in self.scheduler.running)
        return max(0, per_sequence - self.allocator.num_shared_holdings)

    def sequence(self, seq_id: str) -> Sequence | None:
        """The live sequence of a request (read only), or None once it finished or was aborted."""
        return self._sequences.get(seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step -----------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one forward over every scheduled chunk; return the tokens it produced."""
        start_s = time.perf_counter()
        decisions = self.scheduler.schedule(self.clock.now())
        swapped_before = self.swapped_bytes
        for seq, block_ids in decisions.swap_out:
            try:
                self.swapped_bytes += self.runner.swap_out(seq.seq_id, block_ids)
            except Exception:  # noqa: BLE001 - no host copy was kept (pinned memory ran out, ...): recompute it
                # (With tensor parallelism the ranks are out of step after this; the worker gets replaced.)
                logger.exception("swapping out %s failed; it will be recomputed", seq.seq_id)
                self.scheduler.recompute_instead(seq, len(block_ids))
        for seq, block_ids in decisions.swap_in:
            self.swapped_bytes += self.runner.swap_in(seq.seq_id, block_ids)
        chunks = decisions.chunks
        self.last_num_scheduled = len(chunks)
        if not chunks:
            self.clock.step_ran(None, self.swapped_bytes - swapped_before)
            return []
        scheduled_s = time.perf_counter()
        self.last_shape = step_shape(chunks)
        want_hidden = self.probe is not None and any(
            c.completes_sequence_tokens and self.probe.is_due(c.seq.num_output_tokens) for c in chunks)
        if self.grammars:  # structured output's masks, computed while the forward runs
            self.grammars.begin([c.seq.seq_id for c in chunks if c.completes_sequence_tokens])
        logits, hidden, sampling_chunks, scores = self.runner.run(chunks, want_hidden=want_hidden)
        forward_done_s = time.perf_counter()
        seqs = [chunk.seq for chunk in sampling_chunks]
        seq_ids = [s.seq_id for s in seqs]
        token_ids = self.sampler.sample(logits, seq_ids, [s.params for s in seqs],
                                        [(s.prompt_token_ids, s.output_token_ids) for s in seqs],
                                        self.grammars.allowed(seq_ids) if self.grammars else None)
        logprobs = sampled_logprobs(logits, seqs, token_ids)
        prompt_scores = None if scores is None else score_prompts(scores)
        sampled_s = time.perf_counter()
        self.clock.step_ran(self.last_shape, self.swapped_bytes - swapped_before)
        # Progress moves only once sampling succeeded: if it raised, the next
        # step recomputes the same chunks (rewriting the same KV slots).
        for chunk in chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self.scheduler.commit(chunk.seq)
        if scores is not None:
            record_prompt_scores(scores, prompt_scores)
        # KV as this step left it, before finished sequences give blocks back.
        self.last_used_blocks = self.used_blocks()
        self.last_reserved_blocks = self.allocator.num_reserved_blocks
        self.num_steps += 1
        if want_hidden:
            self.num_probe_reads += reprobe(self.probe, self.scheduler, seqs, hidden)
        outputs = [self._append_token(seq, token_id, logprob)
                   for seq, token_id, logprob in zip(seqs, token_ids, logprobs)]
        forward = self.runner.last_times
        self.last_times = StepTimes(
            schedule_s=scheduled_s - start_s, prepare_s=forward.prepare_s, forward_s=forward.forward_s,
            attention_s=forward.attention_s, sample_s=sampled_s - forward_done_s,
            postprocess_s=time.perf_counter() - sampled_s, num_tokens=sum(c.num_tokens for c in chunks),
            num_sequences=len(chunks),
        )
        return outputs

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion (all queued at once); return output token ids in prompt order."""
        param_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(f"got {len(param_list)} sampling params for {len(prompts)} prompts")
        ids = [self.add_request(prompt, p) for prompt, p in zip(prompts, param_list)]
        outputs: dict[str, list[int]] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.is_finished:
                    outputs[out.seq_id] = list(out.output_token_ids)
        return [outputs[seq_id] for seq_id in ids]

    def _append_token(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> StepOutput:
        seq.output_token_ids.append(token_id)
        prompt_logprobs = take_prompt_logprobs(seq)
        now_s = self.clock.now()
        if seq.first_token_s is None:
            seq.first_token_s = now_s
        reason = self._finish_reason(seq, token_id)
        if reason is None:
            if seq.num_output_tokens % LOOP_CHECK_EVERY == 0:
                flag_loop(seq)
            return StepOutput(seq.seq_id, token_id, None, logprob=logprob, prompt_logprobs=prompt_logprobs)
        seq.finish_s = now_s
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self.sampler.forget(seq.seq_id)
        self.grammars.forget(seq.seq_id)
        del self._sequences[seq.seq_id]
        metrics = RequestMetrics(
            arrival_s=seq.arrival_s,
            first_token_s=seq.first_token_s,
            finish_s=now_s,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_preemptions=seq.num_preemptions,
            admitted_s=seq.admitted_s,
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
        )
        return StepOutput(seq.seq_id, token_id, reason, tuple(seq.output_token_ids), metrics, logprob, prompt_logprobs)

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        if self.grammars.advance(seq.seq_id, token_id):  # the structured output is complete
            return "stop"
        if params.forced_output_tokens is not None:
            return "length" if len(seq.output_token_ids) >= params.forced_output_tokens else None
        if len(seq.output_token_ids) >= params.min_tokens:  # before min_tokens nothing but the limit stops it
            if not params.ignore_eos and token_id in self.eos_token_ids or token_id in params.stop_token_ids:
                return "stop"
            if params.stop and hits_stop_string(self.tokenizer, seq.output_token_ids, params.stop,
                                                params.skip_special_tokens):
                return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None


def hits_stop_string(tokenizer, output_token_ids: list[int], stops: tuple[str, ...],
                     skip_special_tokens: bool = True) -> bool:
    """Whether the output's text (special tokens left out unless `skip_special_tokens` is false, as the client gets
    it) contains a stop string, checked after each new token. Only the tail can hold a new match: as many tokens as
    the longest stop has UTF-8 bytes (a byte-level token carries one byte at least: "日本語" may take 9), plus 4 for
    a character split across the window's start."""
    longest_bytes = max(len(stop.encode("utf-8")) for stop in stops)
    tail = tokenizer.decode(output_token_ids[-(longest_bytes + 4):], skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)
    return any(stop in tail for stop in stops)


def _eos_ids(model: torch.nn.Module) -> frozenset[int]:
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, (list, tuple)) else [eos])
