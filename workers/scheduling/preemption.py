"""How a preempted sequence gives up its KV: the same mechanism for every policy, within a stated host budget.

The policy decides *whom* to preempt; this decides *how*, identically for all of them, so a
comparison of policies measures their decisions and not their mechanisms:

    victim --(mode "recompute")--------------------------------> drop the KV, prefill it again later
           --(mode "swap", or "auto" and the cost model says
              copying is cheaper)--> host copy fits swap_space? --yes--> copy out now, back in on re-admission
                                                                --no---> recompute (counted)

The host copies live in `SwapSpace`, a ledger of the blocks each swapped-out sequence holds on the
host. KV that arrives with a moved request waits there too (counted, never refused: the
alternative would be to recompute it), so swap-outs are refused while moved KV fills the budget.
Pure: no torch.
"""

import enum
from dataclasses import dataclass, field

PREEMPTION_MODES = ("auto", "swap", "recompute")


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"  # drop the KV; prefill prompt + outputs again later
    SWAP = "swap"  # copy the KV to host memory; copy it back on re-admission


@dataclass(frozen=True, slots=True)
class PreemptionCostModel:
    """Chooses swap or recompute by estimated seconds.

    Attributes:
        prefill_s_per_token: time to recompute one token's KV.
        swap_bytes_per_s: device<->host copy bandwidth.
        kv_bytes_per_token: KV bytes of one token across all layers.
        swap_overhead_s: fixed cost of one copy, so very short sequences recompute.
    """

    prefill_s_per_token: float = 1e-3
    swap_bytes_per_s: float = 5e9
    kv_bytes_per_token: int = 46_080
    swap_overhead_s: float = 1e-3

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens * self.prefill_s_per_token

    def swap_s(self, num_tokens: int) -> float:
        # out now, back in later, each copy with a fixed launch/bookkeeping cost
        return 2 * (self.swap_overhead_s + num_tokens * self.kv_bytes_per_token / self.swap_bytes_per_s)

    def cheaper_mode(self, num_tokens: int) -> PreemptionMode:
        if self.swap_s(num_tokens) < self.recompute_s(num_tokens):
            return PreemptionMode.SWAP
        return PreemptionMode.RECOMPUTE


@dataclass(frozen=True, slots=True)
class PreemptionRule:
    """The preemption mechanism of one worker's scheduler.

    Attributes:
        mode: "auto" (swap or recompute, whichever `cost_model` estimates cheaper), "swap" (whenever the host
            budget has room) or "recompute" (never copy: vLLM V1's and SGLang's only mechanism).
        swap_space_blocks: KV blocks the host may hold for swapped-out sequences at once; beyond it, recompute.
        cost_model: the estimate "auto" decides by.
    """

    mode: str = "auto"
    swap_space_blocks: int = 0
    cost_model: PreemptionCostModel = field(default_factory=PreemptionCostModel)

    def __post_init__(self) -> None:
        if self.mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode must be one of {', '.join(PREEMPTION_MODES)}, got {self.mode!r}")
        if self.swap_space_blocks < 0:
            raise ValueError(f"swap_space_blocks must be >= 0, got {self.swap_space_blocks}")

    @classmethod
    def for_budget(cls, mode: str, swap_space_bytes: int, bytes_per_block: int, block_size: int) -> "PreemptionRule":
        """The rule of an engine whose KV blocks take `bytes_per_block`: the budget in whole blocks, the cost model
        with this model's KV bytes per token."""
        return cls(mode, swap_space_bytes // bytes_per_block,
                   PreemptionCostModel(kv_bytes_per_token=bytes_per_block // block_size))

    @staticmethod
    def can_swap(mode: str, swap_space_bytes: int) -> bool:
        """Whether a rule of this mode and host budget ever copies a victim instead of recomputing it."""
        return mode != "recompute" and swap_space_bytes > 0

    def wants_swap(self, num_computed_tokens: int) -> bool:
        """Before the budget: would this rule copy a victim holding this much computed KV?"""
        if self.mode == "recompute" or num_computed_tokens == 0:
            return False
        return self.mode == "swap" or self.cost_model.cheaper_mode(num_computed_tokens) is PreemptionMode.SWAP


class SwapSpace:
    """Host blocks held by swapped-out (or moved-in) sequences, against a budget.

    Args:
        budget_blocks: blocks `fits` allows at once.
    """

    def __init__(self, budget_blocks: int) -> None:
        self.budget_blocks = budget_blocks
        self._held: dict[str, int] = {}  # sequence -> host blocks of its copy
        self.num_blocks = 0
        self.peak_blocks = 0

    def fits(self, num_blocks: int) -> bool:
        return self.num_blocks + num_blocks <= self.budget_blocks

    def hold(self, seq_id: str, num_blocks: int) -> None:
        """`seq_id`'s copy now takes `num_blocks` on the host (replacing any it held)."""
        self.release(seq_id)
        self._held[seq_id] = num_blocks
        self.num_blocks += num_blocks
        self.peak_blocks = max(self.peak_blocks, self.num_blocks)

    def release(self, seq_id: str) -> int:
        """Its copy was swapped back in, dropped or given up; returns the blocks freed (0 if it held none)."""
        freed = self._held.pop(seq_id, 0)
        self.num_blocks -= freed
        return freed

    def holds(self, seq_id: str) -> bool:
        return seq_id in self._held
