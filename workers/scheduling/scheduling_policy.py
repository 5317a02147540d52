"""A scheduling policy: a planning rule plus the admission state of one worker's scheduler.

Every policy in `workers.scheduling.policies` is a `SchedulingPolicy`. Its two halves have different owners:

- the planning rule (`workers.scheduling.planning_rule.PlanningRule`): stateless, shared by the router (which
  estimate to plan by), the controller (what to charge a worker) and the worker (what to reserve);
- the admission state (this class's methods): one instance per worker's scheduler, which asks it
  in which order to admit, whether a waiting sequence may join, whom to preempt, and tells it what
  happened (`on_step`, `on_refused`, `on_preempted`) so that it can learn.

The scheduler keeps the sequences and the blocks: a policy never changes a sequence (the bound after
an overrun is an answer the scheduler writes) and never allocates. `can_admit` must not change the
policy either: the scheduler also asks it speculatively (would preempting the less urgent make
room?), and only a real refusal is reported, through `on_refused`. docs/policies.md has the contract
with a complete example policy. Pure decisions: no torch, no Ray, no Redis.
"""

from workers.scheduling.planning_rule import PlanningRule
from workers.values.sequence import Sequence


class SchedulingPolicy(PlanningRule):
    """The decisions one worker's scheduler asks for; every hook has a default (arrival order, admit what the
    blocks allow, preempt the newest, learn nothing), so a policy overrides only where it differs."""

    #: Keep scanning the waiting queue past a request that does not fit.
    is_first_fit: bool = False

    def admission_order(self, waiting: list[Sequence]) -> list[Sequence]:
        """Order in which waiting sequences are considered; arrival order by default."""
        return list(waiting)

    def set_max_queue_wait(self, max_queue_wait_s: float) -> None:
        """The scheduler's starvation bound (`SchedulerConfig.max_queue_wait_s`), handed over once when the scheduler
        is built: a policy whose order ages keeps it; the scheduler enforces the bound itself whatever the order."""

    def can_admit(
        self, seq: Sequence, running: list[Sequence], num_blocks: int, block_size: int, step_token_budget: int
    ) -> bool:
        """Extra admission test beyond "the reservation's blocks are free"; none by default. A question without
        side effects: the scheduler may also ask it of a subset of `running` (would preempting the less urgent
        make room?); when it refuses a waiting sequence for real, it says so through `on_refused`."""
        return True

    def admission_plan(self, seq: Sequence, step_token_budget: int) -> object | None:
        """What `can_admit` weighs of `seq`, for `refused_too`; None (the default): refusals say nothing of others."""
        return None

    def refused_too(self, plan: object, refused_plan: object) -> bool:
        """`can_admit` refused the sequence of `refused_plan`: would it refuse that of `plan` beside the same running
        sequences or more, with no more blocks? The scheduler then skips the question (a long queue is asked about
        at every step while KV is short). False by default: ask."""
        return False

    def choose_victim(self, seq: Sequence, running: list[Sequence]) -> Sequence:
        """Whom to preempt when `seq` cannot grow; the newest running sequence by default."""
        return running[-1]

    def shorter_work_victim(self, seq: Sequence, running: list[Sequence]) -> Sequence | None:
        """Waiting `seq` cannot start (no free slot, or no room): the running sequence (of `running`, none more
        urgent than `seq`) to preempt so that it can, because its work is so much shorter; None (the default):
        nobody is preempted for shorter work. A question without side effects, as `can_admit`."""
        return None

    def on_preempted_for(self, victim: Sequence, seq: Sequence) -> None:
        """The scheduler preempted `victim` for waiting `seq`, as `shorter_work_victim` answered."""

    def on_step(self, running: list[Sequence]) -> None:
        """A step begins with these sequences running; policies that learn from steps update here."""

    def on_refused(self, seq: Sequence, running: list[Sequence]) -> None:
        """`can_admit` refused waiting `seq` beside `running` (the scheduler's real attempt, not a speculative
        question); `seq` stays waiting."""

    def on_preempted(self, victim: Sequence, running: list[Sequence]) -> None:
        """`victim` lost its blocks because a running sequence could not grow (not to make room for a more
        urgent class); `running` are the sequences that kept theirs."""
