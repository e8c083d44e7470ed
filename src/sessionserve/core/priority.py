"""Session-aware ordering: priority classes, least attained service per program, aging.

Pure: no torch, no clock (`now_s` comes in), no I/O. The scheduler asks two
questions of this module each step: in which order do sequences get the step's
token budget and the free blocks, and which waiting sequence is urgent enough
to preempt background work.

- Priority classes: `interactive` (rank 0) before `batch` (rank 1).
- Programs first come, first served: a *program* is an agent session (all
  its turns) or a lone request. Within a class, requests go in the order
  their programs started (`order="program"`), not the order the requests
  came in: an agent's next step goes ahead of the first steps of agents that
  arrived after it, and preemption takes the youngest programs' work first.
  Under load this finishes started work instead of spreading the device over
  ever more half-done sessions, which then preempt each other and wait for
  their KV to come back (bench/RESULTS.md, "Multi-call programs under
  open-loop load"). `order="request"` is the request arrival order.
- Program-level fairness (after Autellix's PLAS), optional: within a class,
  a request whose program had received less service when it arrived (tokens
  computed for its earlier steps) goes first, so a session with many short
  calls does not wait behind one long one at every step. Service is bucketed
  into levels of doubling size (`las_quantum_tokens` x 2^k); within a level,
  the order above. A request keeps its place while it runs: demoting it by
  its own progress would interleave long prefills and hold more KV at once.
- Anti-starvation: a sequence that has waited `aging_s` moves up one class,
  behind that class's own sequences; one that has waited `starvation_s`
  stands with them (and drops to the lowest service level). So every
  sequence is eventually first in line.

`fcfs` ignores all of this: arrival order, as a request-level server does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sessionserve.config import SCHEDULING_ORDERS, SCHEDULING_POLICIES

if TYPE_CHECKING:
    from sessionserve.config import SchedulerConfig

PRIORITY_CLASSES = ("interactive", "batch")


def priority_rank(name: str) -> int:
    """0 for interactive, 1 for batch; ValueError for anything else."""
    try:
        return PRIORITY_CLASSES.index(name)
    except ValueError:
        raise ValueError(f"priority must be one of {', '.join(PRIORITY_CLASSES)}; got {name!r}") from None


@dataclass(frozen=True, slots=True)
class PriorityPolicy:
    policy: str = "priority"
    # Tokens of service in the first (highest) level; level k holds [q(2^k - 1), q(2^(k+1) - 1)).
    # 0: no service levels (classes and aging only). Off by default: on agent traces it
    # favours new sessions' long first prompts over old sessions' short next steps, which
    # costs step latency (bench/RESULTS.md, "Interactive and background agents").
    las_quantum_tokens: int = 0
    # A waiting sequence moves up one class per `aging_s` waited.
    aging_s: float = 5.0
    # Waited this long: first service level, whatever it received before.
    starvation_s: float = 30.0
    # An interactive sequence waiting this long for memory or a batch slot preempts batch work.
    preempt_after_s: float = 0.5
    # Within a class (and service level): "program" start order, or "request" arrival order.
    order: str = "program"
    # While interactive turns are in the batch (or first in line), background prefill gets at most this
    # many tokens of a step; 0: no limit. A long background chunk makes every step long, and a running
    # interactive turn advances one token (or one chunk) per step: its decode would go at the pace of
    # background prefill. Background decodes are not limited.
    background_prefill_tokens: int = 0

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}; got {self.policy!r}")
        if self.order not in SCHEDULING_ORDERS:
            raise ValueError(f"scheduling order must be one of {', '.join(SCHEDULING_ORDERS)}; got {self.order!r}")
        if self.las_quantum_tokens < 0 or self.aging_s <= 0 or self.starvation_s <= 0 or self.preempt_after_s < 0:
            raise ValueError("las_quantum_tokens >= 0, aging_s > 0, starvation_s > 0, preempt_after_s >= 0")
        if self.background_prefill_tokens < 0:
            raise ValueError(f"background_prefill_tokens must be >= 0, got {self.background_prefill_tokens}")

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> PriorityPolicy:
        """The policy a scheduler with `config` orders its queues by."""
        return cls(config.scheduling_policy, config.las_quantum_tokens, config.aging_s, config.starvation_s,
                   config.preempt_after_s, config.scheduling_order, config.resolved_background_prefill_tokens)

    def service_level(self, service_tokens: int) -> int:
        """0 for the first quantum of service, then one level per doubling; always 0 when LAS is off."""
        if self.las_quantum_tokens == 0:
            return 0
        return int(math.log2(1 + service_tokens / self.las_quantum_tokens))

    def effective_rank(self, rank: int, waited_s: float) -> int:
        return max(0, rank - int(waited_s // self.aging_s))

    def key(self, rank: int, service_tokens: int, arrival_s: float, now_s: float | None,
            waiting_since_s: float | None = None, program_start_s: float | None = None
            ) -> tuple[int, int, int, float]:
        """Sort key, smaller first: (class after aging, own class until starving, service level, program
        start or arrival). Aging counts from the request's own arrival (or `waiting_since_s`).

        A sequence aged into a class lines up behind that class's own sequences until it has waited
        `starvation_s`; then it stands with them in program (or arrival) order. (Aged batch work that
        went straight to program order would, under sustained load, put older batch sessions ahead of
        every newer interactive one, and in the running order that preemption takes its victims from.)
        """
        if self.policy == "fcfs":
            return (0, 0, 0, arrival_s)
        since = arrival_s if waiting_since_s is None else waiting_since_s
        waited = 0.0 if now_s is None else max(0.0, now_s - since)
        starving = waited >= self.starvation_s
        level = 0 if starving else self.service_level(service_tokens)
        place = program_start_s if self.order == "program" and program_start_s is not None else arrival_s
        return (self.effective_rank(rank, waited), 0 if starving else rank, level, place)

    def is_urgent(self, rank: int, arrival_s: float, now_s: float | None) -> bool:
        """An interactive sequence that has waited long enough to preempt batch work for."""
        return (self.policy != "fcfs" and rank == 0 and now_s is not None
                and now_s - arrival_s >= self.preempt_after_s)
