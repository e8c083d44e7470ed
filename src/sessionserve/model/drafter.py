"""Draft-model proposer: a smaller model with the same vocabulary proposes k tokens per sequence.

The draft model has its own runner, its own paged KV pool and its own prefix
cache (its KV is a different shape from the target's). For each drafting
sequence it keeps the tokens it holds KV for; at each step it first catches up
on what the target appended since (the accepted tokens and the target's own
token: one or two tokens in steady state, the whole prompt the first time,
less what its prefix cache holds), sampling the first proposal from that
forward, then runs one batched forward per further proposal. KV it wrote for
rejected proposals is simply overwritten: it counts as held only where its
tokens still match the sequence's.

Proposals follow each request's sampling: greedy requests get the draft's
argmax, sampled ones a draw from the draft's distribution under the same
temperature / top-k / top-p / min-p, whose probabilities go to the verifier
(`seq.spec_probs`) for exact rejection sampling.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from sessionserve.cache.kv_manager import KVCacheManager
from sessionserve.config import CacheConfig, ModelConfig
from sessionserve.model.runner import ModelRunner
from sessionserve.model.sampler import logits_to_probs
from sessionserve.types.scheduler_output import ScheduledChunk, SchedulerOutput
from sessionserve.types.sequence import Sequence

logger = logging.getLogger(__name__)


class DraftProposer:
    """Implements `core.spec.Proposer` with a draft model."""

    def __init__(self, model_dir: str | Path, model_config: ModelConfig, kv_cache_bytes: int, block_size: int,
                 target: ModelRunner) -> None:
        self.runner = ModelRunner(model_dir, model_config, CacheConfig(block_size=block_size,
                                                                       kv_cache_bytes=kv_cache_bytes),
                                  target.max_model_len)
        if self.runner.arch.vocab_size != target.arch.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.runner.arch.vocab_size} tokens) differs from "
                             f"the target's ({target.arch.vocab_size}): speculative decoding needs the same tokenizer")
        self.max_model_len = self.runner.max_model_len
        self.kv = KVCacheManager(self.runner.num_blocks, block_size, enable_prefix_caching=True)
        # request id -> (the target's sequence, the tokens whose KV the draft holds, how many of
        # those are the sequence's own tokens: they never change, only the proposals after them may)
        self._held: dict[str, tuple[Sequence, list[int], int]] = {}
        self._generator = torch.Generator(device=self.runner.device)
        self._generator.manual_seed(model_config.seed + 1)
        # A draft token's cost as a fraction of a target decode step, by parameter count, until measured.
        self.relative_cost = self.runner.arch.num_params() / max(1, target.arch.num_params())
        self.forward_s: float | None = None  # EMA of one batched draft forward's wall time
        self.num_forwards = 0

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> None:
        self._release_finished()
        work: list[tuple[Sequence, int, list[int], int]] = []  # seq, k, tokens, start of what to compute
        for seq, k in zip(seqs, num_tokens):
            seq.spec_token_ids = []
            seq.spec_probs = None
            tokens = list(seq.token_ids)
            k = min(k, self.max_model_len - len(tokens))
            if k <= 0:
                continue
            start = self._prepare(seq, tokens, k)
            if start is not None:
                work.append((seq, k, tokens, start))
        if not work:
            return
        drafts: dict[str, list[int]] = {seq.request_id: [] for seq, *_ in work}
        probs: dict[str, list[torch.Tensor]] = {seq.request_id: [] for seq, *_ in work}
        # Forward 1 catches up and proposes the first token; forward j proposes token j.
        for step in range(max(k for _, k, _, _ in work)):
            chunks = []
            for seq, k, tokens, start in work:
                if step >= k:
                    continue
                ids = tokens + drafts[seq.request_id]
                begin = start if step == 0 else len(ids) - 1
                proxy = Sequence(request_id=seq.request_id, token_ids=ids, num_prompt_tokens=len(tokens),
                                 sampling_params=seq.sampling_params, arrival_s=0.0)
                chunks.append(ScheduledChunk(proxy, begin, len(ids) - begin, True))
            plan = SchedulerOutput(tuple(chunks), sum(c.num_tokens for c in chunks), (), self.kv.block_tables)
            t0 = time.perf_counter()
            logits, rows = self.runner.forward_logits(plan)
            elapsed = time.perf_counter() - t0
            if all(c.num_tokens <= 2 for c in chunks):  # a proposal forward, not a catch-up prefill
                self.forward_s = elapsed if self.forward_s is None else 0.9 * self.forward_s + 0.1 * elapsed
            self.num_forwards += 1
            for i, proxy in enumerate(rows):
                params = proxy.sampling_params
                if params.is_greedy:
                    drafts[proxy.request_id].append(int(logits[i].argmax()))
                    continue
                q = logits_to_probs(logits[i].float(), params.temperature, params.top_k, params.top_p, params.min_p)
                drafts[proxy.request_id].append(int(torch.multinomial(q, 1, generator=self._generator)))
                probs[proxy.request_id].append(q)
        for seq, k, tokens, _ in work:
            rid = seq.request_id
            seq.spec_token_ids = drafts[rid]
            if probs[rid]:
                seq.spec_probs = torch.stack(probs[rid])
            # KV now held: the sequence's tokens and every proposal but the last (never fed back)
            self._held[rid] = (seq, tokens + drafts[rid][:-1], len(tokens))
            self.kv.commit_full_blocks(rid, tokens, len(tokens), seq.salt)

    def _prepare(self, seq: Sequence, tokens: list[int], k: int) -> int | None:
        """Blocks for `tokens` plus k - 1 proposals; the first position to compute. None: no room."""
        rid = seq.request_id
        entry = self._held.get(rid)
        if entry is not None and entry[0] is not seq:  # a new request reusing an id
            self.release(rid)
            entry = None
        hit = None
        if entry is None:
            hit = self.kv.find_cached_prefix(rid, tokens, seq.salt)
            start = hit.num_tokens
        else:
            _, held, start = entry
            limit = min(len(held), len(tokens) - 1)  # the last token is always fed: its logits propose
            start = min(start, limit)
            while start < limit and held[start] == tokens[start]:
                start += 1
        if self.kv.allocate(rid, len(tokens) + k - 1, hit) is None:
            self.release(rid)
            return None
        if entry is None:
            self._held[rid] = (seq, tokens[:start], start)
        return start

    def release(self, request_id: str) -> None:
        """Forget a request's draft KV (its full blocks stay in the draft's prefix cache)."""
        if self._held.pop(request_id, None) is not None or request_id in self.kv.block_tables:
            self.kv.free(request_id)

    def _release_finished(self) -> None:
        for rid, (seq, _, _) in list(self._held.items()):
            if seq.is_finished or seq.num_computed_tokens == 0:  # done, or preempted back to the queue
                self.release(rid)
