"""Structured output in an engine: one llguidance matcher per constrained sequence, the tokens each allows at a
step as one bitmask, and the logits of every other token set to -inf before sampling.

    add (its resumed tokens consumed) -> per step: begin(ids) | forward | allowed(ids) -> mask_disallowed
                                         -> sample -> advance(token)
    advance says when the grammar is complete and allows nothing more: the engine ends the output ("stop")

A step's masks depend only on the tokens sampled before it, so `begin` computes them on a helper thread while
the forward runs (llguidance releases the GIL), and `allowed` waits for them. On a GPU the host is idle during
the forward; on this 2-core CPU the helper competes with torch's threads: `bench engine` measured structured over
plain tokens/s 1.00 with the overlap against 0.84 without at 16 rows, but 0.61 against 0.79 at 64 rows (the
fill then takes longer than the forward's single-threaded stretches), so on the CPU only steps of at most
CPU_OVERLAP_MAX_ROWS constrained rows overlap.

Logprobs read the logits before the mask (the model's own distribution).
"""

import functools
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from kv_kernels import cpu_build
from workers.values.grammar import grammar_definition
from workers.values.sampling_params import GrammarSpec

_BITS = torch.arange(32, dtype=torch.int32)  # bit i of a mask word is token 32 * word + i
CPU_OVERLAP_MAX_ROWS = 32


def mask_disallowed(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> a float32 copy with -inf at every token `bitmask` [len(rows), W] int32 does not allow in
    those rows (W = ceil(V' / 32) words for the matchers' V' <= V tokens; tokens past V' are never allowed).
    On the CPU the C++ kernel does it (`kv_kernels/csrc/token_mask.cpp`), elsewhere torch's ops."""
    out = logits.to(torch.float32, copy=True)  # [N, V]
    if out.device.type == "cpu" and cpu_build.is_loaded():
        torch.ops.s3_cpu.mask_disallowed_(out, torch.tensor(rows, dtype=torch.long), bitmask)
        return out
    vocab = out.shape[1]
    allowed = ((bitmask[:, :, None] >> _BITS) & 1).view(len(rows), -1)[:, :vocab].bool()  # [R, <=V]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = torch.tensor(rows, device=out.device)
    out[index] = out[index].masked_fill(~allowed.to(out.device), float("-inf"))
    return out


@functools.cache
def _mask_threads() -> llguidance.LLExecutor:
    """llguidance's thread pool, one per process as torch's is (each engine its own would multiply idle pools)."""
    return llguidance.LLExecutor()


class GrammarMasks:
    """The matchers of an engine's constrained sequences, by sequence id.

    Args:
        tokenizer: the engine's Hugging Face tokenizer (a fast one); None: requests with a grammar are refused.
        vocab_size: the width of the model's logits.
        eos_token_ids: the model's end tokens (a complete grammar lets them end the answer).
        overlap_max_rows: most constrained rows whose masks `begin` computes during the forward (None: any).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=(), overlap_max_rows: int | None = None) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = sorted(eos_token_ids)
        self._overlap_max_rows = overlap_max_rows
        self._vocab_size = vocab_size
        self._lltokenizer = None  # built at the first grammar (about 0.3 s for a 49k vocabulary)
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._executor = _mask_threads()  # fills every row's mask in one GIL-free call, on its own threads
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._pending: tuple[list[str], Future] | None = None

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def add(self, seq_id: str, spec: GrammarSpec, resumed_token_ids: list[int]) -> None:
        """Start matching seq_id's output; ValueError if the grammar cannot be compiled or rejects the tokens it
        already has (a moved request's)."""
        if self._tokenizer is None:
            raise ValueError("structured output needs an engine built with a tokenizer")
        if self._lltokenizer is None:
            from llguidance.hf import from_tokenizer  # here: only a grammar needs it (it imports transformers)

            self._lltokenizer = from_tokenizer(self._tokenizer, n_vocab=self._vocab_size,
                                               eos_token=self._eos_token_ids or None)
        matcher = llguidance.LLMatcher(self._lltokenizer, grammar_definition(spec))
        if matcher.is_error():
            raise ValueError(f"{spec.format}: {matcher.get_error()}")
        if resumed_token_ids and not matcher.consume_tokens(resumed_token_ids):
            raise ValueError(f"the resumed output does not match the grammar: {matcher.get_error()}")
        self._matchers[seq_id] = matcher

    def forget(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)

    def close(self) -> None:
        self._wait()
        self._helper.shutdown(wait=True)

    def begin(self, seq_ids: list[str]) -> None:
        """Start computing the masks of the constrained ones of seq_ids (the sequences a step will sample)."""
        self._wait()  # a step that failed after its begin() may have left one running
        ids = [seq_id for seq_id in seq_ids if seq_id in self._matchers]
        overlaps = ids and (self._overlap_max_rows is None or len(ids) <= self._overlap_max_rows)
        self._pending = (ids, self._helper.submit(self._fill, ids)) if overlaps else None

    def allowed(self, seq_ids: list[str]) -> tuple[list[int], torch.Tensor] | None:
        """The rows of seq_ids with a grammar and their bitmask [R, W] int32 (from `begin`'s work when it covered
        them); None when no row has one."""
        rows = [row for row, seq_id in enumerate(seq_ids) if seq_id in self._matchers]
        pending, self._pending = self._pending, None
        if not rows:
            return None
        wanted = [seq_ids[row] for row in rows]
        if pending is not None:
            bitmask = pending[1].result()  # never leave a fill running over matchers about to advance
            if sorted(pending[0]) == sorted(wanted):  # the same rows, perhaps in the forward's order
                position = {seq_id: i for i, seq_id in enumerate(pending[0])}
                return rows, bitmask[[position[seq_id] for seq_id in wanted]]
        return rows, self._fill(wanted)

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1].exception()  # waits; a failed fill is simply dropped

    def _fill(self, seq_ids: list[str]) -> torch.Tensor:
        # llguidance's own call with the buffer's address (what `llguidance.torch` wraps: importing that module
        # loads torch's compiler, 2 s of every engine's start, for a kernel we do not use)
        bitmask = torch.full((len(seq_ids), (self._vocab_size + 31) // 32), -1, dtype=torch.int32)  # [R, W]
        self._executor.unsafe_compute_mask_ptr([(self._matchers[seq_id], i) for i, seq_id in enumerate(seq_ids)],
                                               bitmask.data_ptr(), bitmask.shape[1] * bitmask.element_size(),
                                               len(seq_ids))
        return bitmask

    def advance(self, seq_id: str, token_id: int) -> bool:
        """Consume a sampled token; True when the output is complete (nothing but EOS may follow) or the matcher
        failed (a token it did not allow: it stops rather than emit text outside the grammar)."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return False
        if not matcher.is_stopped():
            matcher.consume_token(token_id)
        return matcher.is_stopped() or matcher.is_error()
