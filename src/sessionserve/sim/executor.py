"""The cost-model executor: implements the engine's `Executor` by advancing a virtual clock.

It computes nothing: each step takes the time the profile predicts for the
plan's shape, and every sampling chunk gets the same token (not an end of
sequence, so turns run to `max_tokens` exactly as the bench's do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sessionserve.sim.clock import VirtualClock
from sessionserve.sim.cost_model import plan_shape, step_seconds
from sessionserve.sim.profile import StepCost
from sessionserve.types.executor import ExecutorOutput

if TYPE_CHECKING:
    from sessionserve.types.scheduler_output import SchedulerOutput


class CostModelExecutor:
    """`Executor` on a virtual clock. Mutates only the clock and its own counters."""

    def __init__(self, cost: StepCost, clock: VirtualClock, token_id: int) -> None:
        self.cost = cost
        self.clock = clock
        self.token_id = token_id
        self.num_steps = 0
        self.busy_s = 0.0  # simulated seconds spent in steps

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        step_s = step_seconds(plan_shape(plan), self.cost)
        self.clock.advance(step_s)
        self.num_steps += 1
        self.busy_s += step_s
        sampled = {c.seq.request_id: self.token_id for c in plan.chunks if c.samples}
        return ExecutorOutput(sampled, {})
