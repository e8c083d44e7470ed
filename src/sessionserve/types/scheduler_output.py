"""One step's plan: what the scheduler (`core/scheduler.py`) returns and an executor runs.

Frozen data, printed and compared in tests and replayed in `sim/`. The plan refers to live sequences and
the KV manager's block tables: an executor reads them and writes only KV tensors and sampler state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sessionserve.types.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Compute tokens [start, start + num_tokens) of `seq` this step."""

    seq: Sequence
    start: int
    num_tokens: int
    # The chunk reaches the sequence's last token, so a next token is sampled.
    samples: bool
    # Of num_tokens, this many at the end are proposed tokens (seq.spec_token_ids) to verify.
    num_spec: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan. Chunks are ordered: running sequences, then newly admitted ones."""

    chunks: tuple[ScheduledChunk, ...]
    num_batched_tokens: int
    preempted: tuple[str, ...] = ()
    # request id -> block ids, live view of the KV manager's tables (read-only for the executor).
    block_tables: Mapping[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
