"""Token ids for replayed steps: deterministic under a seed, shared where the trace shares a prefix.

A step's new input is `prefix_block_ids` blocks (token ids drawn from the
block id alone, so equal ids give equal tokens in every session) followed by
private tokens (drawn from the session id and step index, so no two sessions
share them by accident). Ids avoid the lowest and highest `RESERVED_IDS` of
the vocabulary, where special tokens live.

`plan_requests` lists what a replay sends, in order per session: the request
sequence that a seed fixes (tested for determinism).
"""

from __future__ import annotations

import random
from typing import NamedTuple

from sessionserve.workload.trace import AgentSession, Step

RESERVED_IDS = 100


class PlannedRequest(NamedTuple):
    session_id: str
    step_index: int
    new_token_ids: tuple[int, ...]
    context_kept_tokens: int | None  # None: append to the whole context
    max_tokens: int
    wait_s: float  # the wait after this step (0 for the last)


class PromptBuilder:
    """Makes token ids for steps. Pure: the same (seed, vocab_size) gives the same ids in any order of calls."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        if vocab_size <= 2 * RESERVED_IDS + 1:
            raise ValueError(f"vocab_size {vocab_size} too small")
        self.vocab_size = vocab_size
        self.seed = seed
        self._blocks: dict[tuple[int, int], tuple[int, ...]] = {}

    def _ids(self, key: str, n: int) -> list[int]:
        rng = random.Random(f"{self.seed}:{key}")
        lo, hi = RESERVED_IDS, self.vocab_size - RESERVED_IDS
        return [rng.randrange(lo, hi) for _ in range(n)]

    def block(self, block_id: int, num_tokens: int) -> tuple[int, ...]:
        """The contents of shared block `block_id` (the first `num_tokens` of them)."""
        key = (block_id, num_tokens)
        if key not in self._blocks:
            self._blocks[key] = tuple(self._ids(f"block:{block_id}", num_tokens))
        return self._blocks[key]

    def step_tokens(self, session_id: str, step_index: int, step: Step) -> list[int]:
        """The new input token ids of `step` (len == step.new_input_tokens)."""
        n = step.new_input_tokens
        ids: list[int] = []
        if step.prefix_block_ids and step.prefix_block_tokens > 0:
            for block_id in step.prefix_block_ids:
                if len(ids) >= n:
                    break
                ids += self.block(block_id, min(step.prefix_block_tokens, n - len(ids)))
        ids += self._ids(f"session:{session_id}:{step_index}", n - len(ids))
        return ids

    def output_tokens(self, session_id: str, step_index: int, n: int) -> list[int]:
        """Stand-in ids for a step's output, for servers that do not return the ids they generated."""
        return self._ids(f"output:{session_id}:{step_index}", n)


def plan_requests(sessions: list[AgentSession] | tuple[AgentSession, ...], builder: PromptBuilder
                  ) -> list[PlannedRequest]:
    """Every request a replay of `sessions` sends, session by session, step by step."""
    return [PlannedRequest(s.session_id, k, tuple(builder.step_tokens(s.session_id, k, step)),
                           step.context_kept_tokens, step.output_tokens, step.wait_s)
            for s in sessions for k, step in enumerate(s.steps)]
