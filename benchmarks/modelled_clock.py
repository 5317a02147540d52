"""A modelled clock for replays through the real engine: time moves by a step-time model of each step's shape.

The engine still computes every token (the predictor, the probe and the policy decide as in the service), but its
arrivals, queue, first tokens and latencies are counted on this clock. On a machine whose speed moves between runs,
two policies then see the same time for the same work, so a difference between them is their schedule. What the
model does not see is counted nowhere: a policy's own host time per step, the probe's reads, Python's pauses.
"""

from benchmarks.step_time import StepModel
from workers.engine.clock import EngineClock
from workers.values.step_output import StepShape

CLOCKS = ("wall", "modelled")  # what a replay's time is: the machine's, or a step-time model's
IDLE_STEP_S = 1e-3  # a step that ran nothing still moves time, so that waiting requests age and the bound acts


class ModelledClock(EngineClock):
    """Starts at 0; each step adds `model`'s time for its shape and its swaps; `wait_until` jumps an idle gap."""

    def __init__(self, model: StepModel) -> None:
        self.model = model
        self.now_s = 0.0

    def now(self) -> float:
        return self.now_s

    def step_ran(self, shape: StepShape | None, swapped_bytes: int) -> None:
        compute_s = IDLE_STEP_S if shape is None else self.model.step_s(shape)
        self.now_s += compute_s + (self.model.swap_s(swapped_bytes) if swapped_bytes else 0.0)

    def wait_until(self, time_s: float) -> None:
        """Nothing runs until `time_s` (the next arrival): the clock goes there at once, without sleeping."""
        self.now_s = max(self.now_s, time_s)
