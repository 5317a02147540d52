"""SGLang's conservative admission without a predictor: the baseline a length predictor must beat (pure).

One of the policies `workers.scheduling.policies` registers (kept in a module of its own: it shares nothing with the
s3 family but the interface).
"""

import math

from workers.scheduling.scheduling_policy import SchedulingPolicy
from workers.values.sequence import Sequence


class SGLangRatioPolicy(SchedulingPolicy):
    """SGLang's conservative admission, the baseline a length predictor must beat (no predictor).

    Blocks are taken on demand. A waiting request is admitted when its prompt plus its whole
    `max_tokens`, together with every running request's held tokens plus its *remaining*
    max_tokens x `ratio`, fit the pool. The ratio starts at `init_ratio` and falls by
    (init - min) / `decay_steps` each step down to `min_ratio`: as requests keep finishing early,
    admission trusts that they will. When a running sequence cannot grow, the one with the fewest
    decoded tokens (the longest prompt among equals) is retracted and recomputed later, and the
    ratio is reset to what the sequences still running have decoded, plus `retract_steps` tokens of
    headroom each, over their max_tokens. A step that starts with nothing running (even with requests
    waiting) returns it to `init_ratio`; SGLang resets when its running batch empties, much the same.

    Differences from SGLang, which retracts in one go until every running request has
    `retract_steps` tokens of room: here one victim is taken at a time, until the growing sequence
    fits (as every policy of this scheduler does); and the victim gives up its KV by the scheduler's
    preemption rule, as every policy's does (SGLang only recomputes: `preemption_mode: recompute`).

    The ratio is state of one worker's scheduler and the test needs every running request's
    progress, so the controller charges a request only what it holds on admission
    (`admits_at_worker`) and the worker's test decides, as SGLang's own scheduler does. Charged
    its plan at `init_ratio` (the controller's copy never steps), the baseline was starved: in a
    simulated LLaMA-30B cluster on A100s it ran at 830 tokens/s, and at 1,994 once the worker decided.
    """

    name = "sglang_ratio"
    holds_plan = False
    admits_at_worker = True

    def __init__(self, init_ratio: float = 0.7, min_ratio: float = 0.1, decay_steps: int = 600,
                 retract_steps: int = 20) -> None:
        if not 0.0 <= min_ratio <= init_ratio <= 1.0:
            raise ValueError(f"need 0 <= min_ratio <= init_ratio <= 1, got {min_ratio} and {init_ratio}")
        if decay_steps < 1 or retract_steps < 0:
            raise ValueError(f"decay_steps must be >= 1 and retract_steps >= 0, got {decay_steps} and {retract_steps}")
        self.init_ratio = init_ratio
        self.min_ratio = min_ratio
        self.decay_per_step = (init_ratio - min_ratio) / decay_steps
        self.retract_steps = retract_steps
        self.ratio = init_ratio

    def planned_output_tokens(self, num_output_tokens, max_tokens, predicted_output_tokens, forced_output_tokens=None):
        return self._expected_output_tokens(num_output_tokens, max_tokens, self.init_ratio)

    @staticmethod
    def _expected_output_tokens(num_output_tokens: int, max_tokens: int, ratio: float) -> int:
        return num_output_tokens + math.ceil((max_tokens - num_output_tokens) * ratio - 1e-9)  # 3.0000000000000004 is 3

    def expected_tokens_of(self, seq: Sequence) -> int:
        """KV tokens running `seq` is expected to hold at its end by the current ratio (the admission test's
        estimate; the planning rule, which the controller shares, stays at `init_ratio`)."""
        if seq.num_output_tokens >= seq.params.max_tokens:
            return seq.num_tokens
        return seq.num_prompt_tokens + self._expected_output_tokens(seq.num_output_tokens, seq.params.max_tokens,
                                                                    self.ratio)

    def can_admit(
        self, seq: Sequence, running: list[Sequence], num_blocks: int, block_size: int, step_token_budget: int
    ) -> bool:
        # The newcomer is charged its whole limit; the running ones what the ratio expects of them.
        need = -(-(seq.num_prompt_tokens + seq.params.max_tokens) // block_size)
        need += sum(-(-self.expected_tokens_of(s) // block_size) for s in running)
        return need <= num_blocks

    def on_step(self, running: list[Sequence]) -> None:
        if not running:
            self.ratio = self.init_ratio
        else:
            self.ratio = max(self.min_ratio, self.ratio - self.decay_per_step)

    def choose_victim(self, seq: Sequence, running: list[Sequence]) -> Sequence:
        return min(running, key=lambda s: (s.num_output_tokens, -s.num_prompt_tokens))

    def on_preempted(self, victim: Sequence, running: list[Sequence]) -> None:
        total_max_tokens = sum(s.params.max_tokens for s in running)
        if total_max_tokens == 0:
            self.ratio = self.init_ratio
            return
        decoded = sum(s.num_output_tokens for s in running)
        self.ratio = min(1.0, (decoded + self.retract_steps * len(running)) / total_max_tokens)
