"""Continuous-batching scheduler: which sequences run this step, and how many tokens each.

Pure: no torch, no clock (`now_s` comes in), no I/O. Given the same queues,
pool and time it returns the same plan. Per step, under a token budget:
  0. both queues are put in the order of the scheduling policy
     (core/priority.py: interactive before batch, least attained service per
     session, aging; or arrival order for `fcfs`); an interactive turn that
     has waited too long for memory or a slot preempts batch work first;
  1. running sequences, in that order (decodes cost one token; a sequence
     mid-prefill gets its next chunk); a batch prefill chunk waits until the
     interactive admissions of step 2 have had the budget;
  2. if a running sequence needs a block and none is free, the last running
     sequence in the order is preempted by recompute: its blocks are freed, it
     goes back to the waiting queue with all its tokens (prompt and output so
     far) and is never dropped;
  3. then waiting sequences in order, each reusing its longest cached prefix,
     while the budget, `max_num_seqs` and free blocks allow; then the deferred
     batch chunks of step 1 with what is left. A waiting sequence whose next
     uncached block a running sequence is prefilling right now (siblings
     started together with the same long prefix: sub-agents, forks, a burst of
     one prompt) waits until that block is cached instead of computing it a
     second time; those behind it may go first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from sessionserve.cache.kv_manager import KVCacheManager
from sessionserve.config import SchedulerConfig
from sessionserve.core.priority import PriorityPolicy
from sessionserve.types.scheduler_output import ScheduledChunk, SchedulerOutput
from sessionserve.types.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class StepBudget:
    """What one step has left to hand out, and what it handed out, as `schedule`'s phases run."""

    tokens: int  # batched tokens left
    background: int  # of which background (batch-class) prefills may still take this many
    prefill: int  # of which prefill chunks (any class) may still take this many
    yield_key: tuple[int, int, int, float] | None  # batch prefills ranking after this key yield to it
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids preempted by recompute this step

    def limit(self, background: bool, prefill: bool = True) -> int:
        """Tokens a chunk may take: prefills also within their share, background prefills within theirs."""
        n = min(self.tokens, self.background) if background else self.tokens
        return min(n, self.prefill) if prefill else n

    def take(self, chunk: ScheduledChunk, background: bool) -> None:
        self.chunks.append(chunk)
        self.tokens -= chunk.num_tokens
        if background:
            self.background -= chunk.num_tokens
        if chunk.num_tokens - chunk.num_spec > 1:
            self.prefill -= chunk.num_tokens


class Scheduler:
    """Owns the waiting and running queues; the KV manager owns the blocks."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.policy = PriorityPolicy.from_config(config)
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Batch sequences preempted so that a waiting interactive one could run.
        self.num_priority_preemptions = 0
        # Blocks the first waiting sequence needed and could not get in the last schedule().
        self.num_wanted_blocks = 0
        # Admissions put off because a running sequence was computing their next prefix block.
        self.num_prefix_waits = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def check_fits(self, seq: Sequence) -> None:
        """Raise ValueError if `seq` could never fit in the cache, even alone."""
        if self.kv.blocks_needed(seq.num_tokens + 1) > self.kv.pool.num_blocks:
            raise ValueError(
                f"request {seq.request_id} needs {seq.num_tokens + 1} tokens of KV, more than the whole cache "
                f"({self.kv.pool.num_blocks * self.kv.block_size} tokens)")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        # A sequence may never outgrow the whole cache: it stops ("length") where it would,
        # instead of preempting itself forever.
        seq.max_model_len = min(seq.max_model_len, self.kv.pool.num_blocks * self.kv.block_size)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def order(self, now_s: float | None) -> Callable[[Sequence], tuple[int, int, int, float]]:
        """The key waiting turns are taken in at `now_s` (priority classes, program order, aging)."""
        return lambda seq: self._key(seq, now_s)

    def _key(self, seq: Sequence, now_s: float | None) -> tuple[int, int, int, float]:
        # Aging is for waiting: a running sequence ranks with the class it was admitted with. (A batch turn
        # that runs long is not starving; ranked up by its age it would put interactive turns behind it in
        # the running order, where preemption takes its victims.)
        if seq.status is SequenceStatus.RUNNING and seq.admitted_s is not None:
            now_s = seq.admitted_s
        return self.policy.key(seq.priority, seq.service_at_arrival, seq.arrival_s, now_s,
                               program_start_s=seq.program.start_s)

    def schedule(self, now_s: float | None = None, prefill_tokens: int | None = None) -> SchedulerOutput:
        """Plan one step. `now_s` (any clock) drives aging and urgency; None: no aging. `prefill_tokens`: the
        most prompt tokens the step computes while running sequences decode (their next token waits for the
        step: a long prompt's chunk would stall every stream); None: only the token budget bounds them."""
        if not self.running and not self.waiting:  # idle: most ticks of a server whose agents wait on tools
            self.num_wanted_blocks = 0
            return SchedulerOutput((), 0, (), self.kv.block_tables)
        prioritized = self.policy.policy != "fcfs"
        urgent_preempted = self._order(now_s) if prioritized else []
        step = self._step_budget(now_s, prioritized, prefill_tokens)
        deferred = self._schedule_running(step, now_s)
        # NOTE: no admissions in a step that preempted: memory is short, and
        # admitting now would only preempt again next step.
        self.num_wanted_blocks = 0
        if not step.preempted:
            self._admit_waiting(step, now_s, prioritized)
        self._fill_deferred(step, deferred)
        return SchedulerOutput(tuple(step.chunks), self.config.max_num_batched_tokens - step.tokens,
                               tuple(urgent_preempted + step.preempted), self.kv.block_tables)

    def _order(self, now_s: float | None) -> list[str]:
        """Phase 0: both queues in the policy's order; an urgent interactive turn preempts batch work.
        Returns the preempted request ids."""
        if len(self.running) > 1:
            self.running.sort(key=lambda s: self._key(s, now_s))
        if len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=lambda s: self._key(s, now_s)))
        urgent_preempted = self._preempt_for_urgent(now_s)
        if urgent_preempted:
            self.waiting = deque(sorted(self.waiting, key=lambda s: self._key(s, now_s)))
        return urgent_preempted

    def _step_budget(self, now_s: float | None, prioritized: bool, prefill_tokens: int | None) -> StepBudget:
        """The step's token budget, how much of it background prefills may take (limited while interactive
        turns run or are first in line), and how much prefills may take (`prefill_tokens` while a running
        sequence decodes)."""
        budget = self.config.max_num_batched_tokens
        prefill = budget
        if prefill_tokens is not None and any(s.num_uncomputed_tokens == 1 for s in self.running):
            prefill = max(1, prefill_tokens)
        # Batch prefill chunks that rank below the first waiting interactive turn yield it the budget.
        first_interactive = next((s for s in self.waiting if s.priority == 0 and not s.is_blocked), None) \
            if prioritized else None
        background = budget
        if prioritized and self.policy.background_prefill_tokens and (
                first_interactive is not None or any(s.priority == 0 for s in self.running)):
            background = self.policy.background_prefill_tokens
        yield_key = self._key(first_interactive, now_s) if first_interactive is not None else None
        return StepBudget(budget, background, prefill, yield_key)

    def _schedule_running(self, step: StepBudget, now_s: float | None) -> list[Sequence]:
        """Phase 1: running sequences in order, preempting from the end when a block is short (phase 2).
        Returns the background prefills deferred until the admissions have had the budget."""
        deferred: list[Sequence] = []
        i = 0
        while i < len(self.running) and step.tokens > 0:
            seq = self.running[i]
            prefill = seq.num_uncomputed_tokens > 1
            bg_prefill = seq.priority > 0 and prefill
            if bg_prefill and (step.background <= 0 or step.yield_key is not None
                               and self._key(seq, now_s) > step.yield_key):
                deferred.append(seq)
                i += 1
                continue
            if prefill and step.prefill <= 0:  # its next chunk waits for a step with prefill room
                i += 1
                continue
            chunk = self._chunk_or_preempt(seq, step.limit(bg_prefill, prefill), step.preempted)
            if chunk is None:
                break  # seq itself was preempted: nothing more fits
            step.take(chunk, bg_prefill)
            i += 1
        return deferred

    def _admit_waiting(self, step: StepBudget, now_s: float | None, prioritized: bool) -> None:
        """Phase 3: waiting sequences in order, each from its longest cached prefix, while the budget, the
        sequence limit and free blocks allow."""
        skipped: list[Sequence] = []
        while self.waiting and step.tokens > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.is_blocked or (seq.priority > 0 and step.background <= 0):  # KV still coming back; no room
                skipped.append(self.waiting.popleft())
                continue
            if seq.request_id in self.kv.block_tables:  # resumes with KV it already holds
                start = seq.num_computed_tokens
                hit = None
            else:
                hit = self.kv.find_cached_prefix(seq.request_id, seq.token_ids, seq.salt)
                start = hit.num_tokens
                if self._prefix_in_flight(seq, len(hit.blocks)):
                    skipped.append(self.waiting.popleft())
                    self.num_prefix_waits += 1
                    continue
            num_new = seq.num_tokens - start
            limit = step.limit(seq.priority > 0, num_new > 1)
            if limit <= 0 or num_new > limit and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, limit)
            whole = self.kv.num_blocks_required(seq.request_id, seq.num_tokens, hit) if prioritized else 0
            if whole > self.kv.num_free_blocks and not self._reclaim_from_waiting(seq, whole):
                # Its prompt would not fit even once all its chunks ran: admitting it would only preempt
                # others (or itself) chunk by chunk. It waits for room (the residency policy sees the
                # demand); turns behind it that fit go ahead, until it has waited `starvation_s`.
                self.num_wanted_blocks = max(self.num_wanted_blocks, whole)
                if now_s is not None and now_s - seq.arrival_s < self.policy.starvation_s:
                    skipped.append(self.waiting.popleft())
                    continue
                break
            if self.kv.allocate(seq.request_id, start + num_new, hit) is None:
                self.num_wanted_blocks = self.kv.num_blocks_required(seq.request_id, start + num_new, hit)
                # Queued sequences behind this one may hold blocks (resumed sessions): take them back.
                if not self._reclaim_from_waiting(seq, self.num_wanted_blocks) or \
                        self.kv.allocate(seq.request_id, start + num_new, hit) is None:
                    break
                self.num_wanted_blocks = 0
            self.waiting.popleft()
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = start
                self.kv.pool.record_query(seq.num_prompt_tokens, start)
            seq.num_computed_tokens = start
            seq.status = SequenceStatus.RUNNING
            seq.admitted_s = now_s
            self.running.append(seq)
            step.take(ScheduledChunk(seq, start, num_new, start + num_new == seq.num_tokens), seq.priority > 0)
        self.waiting.extendleft(reversed(skipped))

    def _fill_deferred(self, step: StepBudget, deferred: list[Sequence]) -> None:
        """Last: the deferred background chunks take what the admissions left (no preemption for them)."""
        for seq in deferred:
            num_new = min(seq.num_uncomputed_tokens, step.tokens, step.background, step.prefill)
            if num_new <= 0:
                break
            if self.kv.allocate(seq.request_id, seq.num_computed_tokens + num_new) is None:
                continue  # it retries next step
            step.take(ScheduledChunk(seq, seq.num_computed_tokens, num_new,
                                     seq.num_computed_tokens + num_new == seq.num_tokens), True)
        if not step.chunks and deferred and not step.preempted:
            # Nothing else could run (the interactive turn waits for memory the deferred ones hold):
            # the first deferred chunk goes ahead, preempting from the end of the order as phase 1 does.
            chunk = self._chunk_or_preempt(deferred[0], step.tokens, step.preempted)
            if chunk is not None:
                step.take(chunk, False)

    def _prefix_in_flight(self, seq: Sequence, index: int) -> bool:
        """True if a running sequence is computing block `index` of `seq`'s prefix (same chained hash), which
        `seq` could use once it is cached: the first block past `seq`'s cache hit that it may reuse."""
        if index >= (len(seq.token_ids) - 1) // self.kv.block_size:
            return False  # its last token is computed anyway; nothing more to reuse
        block_hash = self.kv.block_hash(seq.request_id, index)
        return block_hash is not None and any(
            other.num_computed_tokens < other.num_tokens - 1 and self.kv.computes_block(other.request_id, index,
                                                                                          block_hash)
            for other in self.running)

    def _chunk_or_preempt(self, seq: Sequence, budget: int, preempted: list[str]) -> ScheduledChunk | None:
        """The next chunk of running `seq`, preempting from the end of the running order until it fits.

        None when `seq` itself was preempted (appended to `preempted` like every victim).
        """
        num_new = min(seq.num_uncomputed_tokens, budget)
        # A decode with proposed tokens verifies them in the same chunk, if budget and free blocks
        # allow; drafts are dropped before anything is preempted for them.
        num_spec = min(len(seq.spec_token_ids), budget - num_new) if seq.num_uncomputed_tokens == 1 else 0
        if num_spec > 0 and self.kv.allocate(seq.request_id, seq.num_computed_tokens + 1 + num_spec) is None:
            num_spec = 0
        del seq.spec_token_ids[num_spec:]
        while num_spec == 0 and self.kv.allocate(seq.request_id, seq.num_computed_tokens + num_new) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is seq:
                return None
        return ScheduledChunk(seq, seq.num_computed_tokens, num_new + num_spec,
                              seq.num_computed_tokens + num_new == seq.num_tokens, num_spec)

    def _preempt_for_urgent(self, now_s: float | None) -> list[str]:
        """Preempt batch sequences (last in order first) so the first waiting turn can start.

        Only when that turn is interactive, has waited `preempt_after_s`, and
        lacks a batch slot or free blocks. Blocks counted without its prefix-cache
        hit: may free a little more than needed, never less.
        """
        head = next((s for s in self.waiting if not s.is_blocked), None)
        if head is None or not self.policy.is_urgent(head.priority, head.arrival_s, now_s):
            return []
        held = len(self.kv.block_tables.get(head.request_id, ()))
        need_blocks = max(0, self.kv.blocks_needed(head.num_tokens) - held)
        head_key = self._key(head, now_s)
        victims: list[str] = []
        for seq in reversed(list(self.running)):
            if len(self.running) < self.config.max_num_seqs and self.kv.num_free_blocks >= need_blocks:
                break
            # Only batch work that still ranks below the waiting turn: a batch sequence aged past it
            # would be readmitted ahead of it at once (preempting it again and again, livelock).
            if seq.priority == 0 or self._key(seq, now_s) <= head_key:
                continue
            self.running.remove(seq)
            self._preempt(seq)
            self.num_priority_preemptions += 1
            victims.append(seq.request_id)
        return victims

    def update(self, output: SchedulerOutput, sampled: Mapping[str, int],
               accepted: Mapping[str, list[int]] | None = None) -> list[Sequence]:
        """Apply a finished step: advance progress, append sampled tokens, stop. Returns finished sequences.

        `sampled` maps request id -> token for every chunk that `samples`;
        `accepted` maps request id -> the proposed tokens the target accepted
        (a prefix of seq.spec_token_ids), which come before the sampled token.
        """
        finished: list[Sequence] = []
        for chunk in output.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            token = sampled.get(seq.request_id)
            new_tokens = [] if token is None else [token]
            num_kept = chunk.num_tokens
            if chunk.num_spec:
                drafts = accepted.get(seq.request_id, []) if accepted is not None else []
                new_tokens = drafts + new_tokens
                num_kept = chunk.num_tokens - chunk.num_spec + len(drafts)  # rejected drafts' KV is stale
                seq.num_spec_proposed += chunk.num_spec
                seq.num_spec_accepted += len(drafts)
            seq.spec_token_ids.clear()
            seq.num_computed_tokens = chunk.start + num_kept
            seq.program.service_tokens += chunk.num_tokens
            status = None
            for tok in new_tokens:
                seq.token_ids.append(tok)
                status = seq.check_stop(tok)
                if status is not None:
                    break
            if status is not None:
                # Accepted drafts computed past the stop are not part of the sequence; the last token
                # counts as uncomputed even when it was an accepted draft, as after any other step.
                seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq.token_ids) - 1)
                self.finish(seq, status)
                finished.append(seq)
                continue
            self.kv.commit_full_blocks(seq.request_id, seq.token_ids, seq.num_computed_tokens, seq.salt)
        return finished

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark `seq` finished with `status` and free its blocks. Idempotent."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = status
        self.kv.commit_full_blocks(seq.request_id, seq.token_ids, seq.num_computed_tokens, seq.salt)
        if seq.kv_successor is not None and seq.request_id in self.kv.block_tables:
            self.kv.rename(seq.request_id, seq.kv_successor)
        else:
            self.kv.free(seq.request_id)

    def _reclaim_from_waiting(self, keep: Sequence, num_blocks: int) -> bool:
        """Free blocks held by waiting sequences (last queued first) until `num_blocks` are free.

        Each one falls back to recompute (its full blocks stay in the prefix
        cache until evicted). Nothing is freed unless that makes enough room:
        dropping KV (a restored session's, say) and then not admitting anyway
        would only make it recompute, step after step. True if enough blocks
        are free now.
        """
        short = num_blocks - self.kv.num_free_blocks
        if short <= 0:
            return True
        ref_counts = self.kv.pool.ref_counts
        released: dict[int, int] = {}  # block -> references the chosen victims drop
        victims: list[Sequence] = []
        for seq in reversed(self.waiting):
            if short <= 0:
                break
            table = self.kv.block_tables.get(seq.request_id)
            if seq is keep or seq.is_blocked or not table:
                continue
            victims.append(seq)
            for block in table:
                released[block] = released.get(block, 0) + 1
                if released[block] == ref_counts[block]:
                    short -= 1
        if short > 0:
            return False
        for seq in victims:
            self.kv.commit_full_blocks(seq.request_id, seq.token_ids, seq.num_computed_tokens, seq.salt)
            self.kv.free(seq.request_id)
            seq.num_computed_tokens = 0
            seq.num_preemptions += 1
            self.num_preemptions += 1
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.kv.commit_full_blocks(seq.request_id, seq.token_ids, seq.num_computed_tokens, seq.salt)
        self.kv.free(seq.request_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
