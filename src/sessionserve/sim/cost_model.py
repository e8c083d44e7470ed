"""Step time of a scheduler plan under a `CostProfile` (pure: no clock, no state)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from sessionserve.sim.profile import StepCost

if TYPE_CHECKING:
    from sessionserve.types.scheduler_output import SchedulerOutput


class StepShape(NamedTuple):
    """What a step's cost depends on (see profile.py for the model)."""

    num_seqs: int  # chunks in the step
    num_tokens: int  # tokens computed
    num_attn_pairs: int  # sum over computed tokens of the context each attends to (itself included)
    num_kv_tokens: int  # sum over chunks of the context length read


def shape_of(chunks: list[tuple[int, int]]) -> StepShape:
    """The shape of a step made of `(start, num_tokens)` chunks."""
    num_tokens = num_pairs = num_kv = 0
    for start, n in chunks:
        num_tokens += n
        # Token i of the chunk (0-based) attends to start + i + 1 positions.
        num_pairs += n * start + n * (n + 1) // 2
        num_kv += start + n
    return StepShape(len(chunks), num_tokens, num_pairs, num_kv)


def plan_shape(plan: SchedulerOutput) -> StepShape:
    return shape_of([(c.start, c.num_tokens) for c in plan.chunks])


def step_seconds(shape: StepShape, cost: StepCost) -> float:
    """Predicted wall time of one engine step of this shape (0 for an empty step)."""
    if shape.num_seqs == 0:
        return 0.0
    compute = cost.per_token_s * shape.num_tokens + cost.per_attn_s * shape.num_attn_pairs
    memory = cost.floor_s + cost.per_kv_token_s * shape.num_kv_tokens
    return cost.overhead_s + cost.per_seq_s * shape.num_seqs + max(compute, memory)
