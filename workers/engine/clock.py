"""The clock an engine reads time from.

The service runs on the wall clock. A benchmark may pass a modelled one instead, whose time moves by a step-time
model of each step's shape, so that the latencies it compares between policies do not carry the machine's drift.
"""

import time

from workers.values.step_output import StepShape


class EngineClock:
    """The wall clock: `now` stamps arrivals, the scheduler's view and every token; `step_ran` is told of each step
    once its tokens are sampled and before they are stamped (the wall clock moved by itself)."""

    def now(self) -> float:
        return time.monotonic()

    def step_ran(self, shape: StepShape | None, swapped_bytes: int) -> None:
        """A step ran: `shape` is what it computed (None when it only swapped), `swapped_bytes` what it moved."""

    def wait_until(self, time_s: float) -> None:
        """Nothing runs until `time_s` on this clock (a replay's next arrival): sleep until then."""
        time.sleep(max(0.0, time_s - self.now()))
