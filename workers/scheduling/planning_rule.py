"""A policy's planning rule: the stateless part that the router, the controller and every worker share.

The rule says which of the predictor's estimates a policy plans by, how many KV tokens a request is
planned to hold at its peak, what the controller's ledger charges a worker for it, what a worker
reserves when it admits it, and which bound a sequence works to after it outran its plan. Its
answers depend only on their arguments and on the constants given to the constructor, so the
router and the controller may hold one instance for the life of the service, and a request moved
between workers is planned the same in both. What one worker's scheduler decides and learns step by
step (whom to admit first, whom to preempt, how full to run) is `workers.scheduling.scheduling_policy`'s.

Pure: no torch, no Ray, no Redis. docs/policies.md walks through the whole contract with a complete
example policy.
"""

import abc

from workers.values.sequence import Sequence


class PlanningRule(abc.ABC):
    """How much KV a policy plans per request, from which estimate; stateless.

    A subclass sets `name` and implements `planned_output_tokens`; every other method has a default.
    """

    name: str = "abstract"
    #: The allocator reserves the whole plan at admission; False: blocks on demand, the plan only decides admission.
    holds_plan: bool = True
    #: Usable by the service; False for benchmark instruments (they need the true output length).
    is_serving: bool = True
    #: Plans by `predicted_output_tokens` as a prediction the worker may refine (a length probe's answers go there).
    reads_prediction: bool = False
    #: The worker's admission test needs what the controller cannot see (every running sequence's progress), so
    #: the controller charges a request only what it holds on admission and leaves the rest to that test.
    admits_at_worker: bool = False

    def prediction_from(self, point_tokens: int, upper_tokens: int) -> int:
        """Which of a predictor's two answers this policy plans by: the upper bound when it reserves its plan
        whole (an overrun there costs a preemption), the point when it takes blocks on demand and only admits
        by the plan (an overrun there stretches the plan; `length_probe.remaining_for` chooses the same way)."""
        return upper_tokens if self.holds_plan else point_tokens

    @abc.abstractmethod
    def planned_output_tokens(self, num_output_tokens: int, max_tokens: int, predicted_output_tokens: int | None,
                              forced_output_tokens: int | None = None) -> int:
        """Output tokens the plan covers (the part of `planned_tokens` that differs between policies)."""

    def planned_tokens(self, num_prompt_tokens: int, num_output_tokens: int, max_tokens: int,
                       predicted_output_tokens: int | None, forced_output_tokens: int | None = None) -> int:
        """KV tokens a request is planned to hold at its peak: the one rule router, controller and worker share.

        Raises ValueError for values no request can have (the message shows them).
        """
        if num_prompt_tokens < 1 or max_tokens < 1:
            raise ValueError(f"num_prompt_tokens and max_tokens must be >= 1, got {num_prompt_tokens} and {max_tokens}")
        if not 0 <= num_output_tokens < max_tokens:
            raise ValueError(f"num_output_tokens must be in [0, max_tokens={max_tokens}) for a request that still "
                             f"generates, got {num_output_tokens}")
        planned = self.planned_output_tokens(num_output_tokens, max_tokens, predicted_output_tokens,
                                             forced_output_tokens)
        return num_prompt_tokens + max(num_output_tokens, planned)

    def placement_tokens(self, num_prompt_tokens: int, num_output_tokens: int, max_tokens: int,
                         predicted_output_tokens: int | None, forced_output_tokens: int | None = None) -> int:
        """KV tokens the controller's ledger charges a worker for a request: its plan (`planned_tokens`), or,
        for a policy whose worker admits by its own test (`admits_at_worker`), the tokens it holds on admission.

        Raises ValueError as `planned_tokens` does.
        """
        planned = self.planned_tokens(num_prompt_tokens, num_output_tokens, max_tokens, predicted_output_tokens,
                                      forced_output_tokens)
        return num_prompt_tokens + num_output_tokens if self.admits_at_worker else planned

    def planned_tokens_of(self, seq: Sequence) -> int:
        """`planned_tokens` of a live sequence (it may have reached max_tokens: then what it holds)."""
        if seq.num_output_tokens >= seq.params.max_tokens:
            return seq.num_tokens
        return self.planned_tokens(seq.num_prompt_tokens, seq.num_output_tokens, seq.params.max_tokens,
                                   seq.predicted_output_tokens, seq.params.forced_output_tokens)

    def reservation_tokens(self, seq: Sequence) -> int:
        """Tokens of KV to reserve when `seq` is admitted: its plan, or (on demand) what it holds."""
        if self.holds_plan:
            return max(seq.num_tokens, self.planned_tokens_of(seq))
        return seq.num_tokens

    def growth_tokens(self, seq: Sequence) -> int:
        """Tokens to grow a reservation to when `seq` needs more than it holds."""
        return seq.num_tokens

    def bound_after_overrun(self, seq: Sequence) -> int | None:
        """The output bound `seq` plans by from now on, when it needs more than its reservation; None keeps the
        one it has. The scheduler writes the answer into `seq.predicted_output_tokens` (and counts a
        misprediction when it changed): a rule never changes a sequence itself."""
        return None
