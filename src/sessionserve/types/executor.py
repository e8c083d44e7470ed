"""The executor interface: what the engine loop calls to run one planned step.

The real executor is `sessionserve.model.runner.ModelRunner`; the simulator
implements the same interface with a cost model on a virtual clock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from sessionserve.types.scheduler_output import SchedulerOutput


class ExecutorOutput(NamedTuple):
    # request id -> sampled next token, for every chunk in the plan that samples.
    sampled: dict[str, int]
    # request id -> {token id: logprob}: the chosen token and the top-n, when asked for.
    logprobs: dict[str, dict[int, float]]
    # request id -> the proposed tokens the target accepted, for chunks that verified drafts;
    # they come before the sampled token.
    accepted: dict[str, list[int]] = {}  # noqa: RUF012 - never mutated


class Executor(Protocol):
    """Runs planned steps over the KV blocks the scheduler assigned."""

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        """Compute every chunk of `plan`, writing their K/V into the sequences' blocks.

        Reads the sequences' token ids and block tables; mutates only the KV
        tensors and per-request sampler state. Safe to call again as soon as it returns.
        """
        ...
