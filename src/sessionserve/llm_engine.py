"""Text-level engine: tokenization, stop strings and streaming outputs around `EngineCore`.

`LLMEngine` is the step-level API the server drives (add_request / step /
abort); `sessionserve.llm.LLM` is the offline convenience on top of it.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from sessionserve.cache.block_pool import BlockPool
from sessionserve.cache.disk_tier import DiskTier
from sessionserve.cache.host_prefix_cache import HostPrefixCache
from sessionserve.cache.host_tier import HostTier
from sessionserve.cache.kv_layout import KVLayout
from sessionserve.cache.kv_store import KVStore, model_namespace
from sessionserve.cache.kv_store_client import KVStoreClient
from sessionserve.cache.mover import ThreadMover
from sessionserve.config import Config
from sessionserve.core.assembly import COST_UPDATE_STEPS, Mechanisms, assemble
from sessionserve.core.residency import MoveCosts
from sessionserve.core.session import Session
from sessionserve.core.spec import NgramProposer, Proposer, SpecPolicy
from sessionserve.model.runner import ModelRunner
from sessionserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from sessionserve.obs.cpu_roles import release_compute_threads
from sessionserve.obs.native_memory import HeapTrimmer
from sessionserve.types.kv_mover import Tier
from sessionserve.types.sampling_params import SamplingParams
from sessionserve.types.sequence import ParkHint, Sequence, SequenceStatus



@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    """Cumulative state of one request, plus what the last step added (`delta_*`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    arrival_s: float = 0.0
    scheduled_s: float | None = None
    restore_wait_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float | None = None
    # Why the request failed inside an engine step (its inputs made the step raise); None: it did not.
    error: str | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass(slots=True)
class _Tracked:
    seq: Sequence
    prompt: str | None
    detok: IncrementalDetokenizer | None  # None: decode once at the end (no stop strings, no streaming)
    # The prompt's ids, copied at the first output (a held session turn gets its context when it starts):
    # every later output shares this list, where a copy per streamed token was O(context) each step.
    prompt_token_ids: list[int] | None = None


class LLMEngine:
    """Owns the tokenizer and an `EngineCore` wired to a `ModelRunner`."""

    def __init__(self, config: Config, model_dir: str | Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.model_dir = Path(model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        self.runner = ModelRunner(self.model_dir, config.model, config.cache, config.scheduler.max_model_len)
        eos = self.runner.arch.eos_token_ids or ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id else ())
        proposer, spec_policy = self._make_proposer(config)
        parts = assemble(config, Mechanisms(
            executor=self.runner, clock=clock, num_blocks=self.runner.num_blocks,
            max_model_len=self.runner.max_model_len, eos_token_ids=tuple(eos),
            mover=lambda: self._make_mover(config),
            host_prefix_cache=lambda pool, budget: HostPrefixCache(self.runner.kv_caches, pool, budget),
            shared_store=lambda pool: self._make_kv_store(config, pool),
            proposer=proposer, spec_policy=spec_policy))
        self.kv, self.sessions, self.core, self.mover = parts.kv, parts.sessions, parts.core, parts.mover
        self.host_prefix_cache, self.kv_store = parts.host_prefix_cache, parts.shared_store
        self._clock = clock
        self._heap = HeapTrimmer()
        self._tracked: dict[str, _Tracked] = {}
        self._next_id = 0

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def new_request_id(self) -> str:
        self._next_id += 1
        return f"req-{self._next_id}"

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    stream: bool = False, salt: bytes = b"", session_id: str | None = None,
                    priority: str | None = None, park_hint: ParkHint | None = None) -> str:
        """Queue a prompt (text or token ids). Returns the request id. Raises ValueError on bad input.

        With `session_id`, `prompt` is the session's new turn only (e.g. tool
        results and the next assistant header); what the session holds is not
        sent, tokenized or prefilled again. `priority`: "interactive" | "batch"
        (default: the session's, else interactive). `park_hint`: what the session waits on once the turn
        ends (the client's expected tool time, the tools its reply calls).
        """
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            if any((not isinstance(t, int)) or t < 0 or t >= self.runner.arch.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {self.runner.arch.vocab_size})")
        params.check_vocab(self.runner.arch.vocab_size)
        rid = request_id or self.new_request_id()
        if params.guided is not None:
            # Compile now (cached by spec): a bad schema is this request's 400, never a failed engine step.
            self.runner.grammar_compiler.compile(params.guided)
        seq = self.core.add_request(rid, ids, params, salt, session_id=session_id, priority=priority,
                                    park_hint=park_hint)
        detok = None
        if stream or params.stop:
            detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
        self._tracked[rid] = _Tracked(seq, text, detok)
        return rid

    def _make_proposer(self, config: Config) -> tuple[Proposer | None, SpecPolicy]:
        spec = config.speculative
        # The engine measures where decode steps turn compute-bound (core.spec.StepCostFit).
        policy = SpecPolicy(max_tokens=spec.num_speculative_tokens, adaptive=spec.spec_adaptive)
        if spec.speculative_method == "ngram":
            return NgramProposer(spec.ngram_max, spec.ngram_min), policy
        if spec.speculative_method == "draft":
            from sessionserve.model.drafter import DraftProposer

            assert spec.draft_model is not None
            draft_model = config.model if spec.draft_dtype is None else replace(config.model, dtype=spec.draft_dtype)
            drafter = DraftProposer(spec.draft_model, draft_model, spec.draft_kv_cache_bytes,
                                    config.cache.block_size, self.runner)
            return drafter, replace(policy, draft_cost=drafter.relative_cost)
        return None, policy

    def _make_mover(self, config: Config) -> ThreadMover:
        sc = config.session
        layout = KVLayout.from_kv_caches(self.runner.kv_caches)
        host = HostTier(layout, sc.host_kv_bytes, quantize_int8=sc.host_kv_int8,
                        pin_memory=self.runner.device.type == "cuda") if sc.host_kv_bytes else None
        disk = None
        if sc.disk_kv_bytes:
            spool = sc.spool_dir or tempfile.mkdtemp(prefix="sessionserve-spool-")
            disk = DiskTier(layout, spool, sc.disk_kv_bytes)
        return ThreadMover(self.runner.kv_caches, host, disk, when_idle=release_compute_threads)

    def _make_kv_store(self, config: Config, pool: BlockPool) -> KVStoreClient:
        assert config.session.kv_store_dir is not None
        layout = KVLayout.from_kv_caches(self.runner.kv_caches)
        store = KVStore(config.session.kv_store_dir, model_namespace(self.model_dir, layout), layout,
                        config.session.kv_store_bytes)
        return KVStoreClient(store, self.runner.kv_caches, pool)

    # -- sessions ---------------------------------------------------------------------------

    def open_session(self, session_id: str | None = None, tenant: str = "", priority: str = "interactive") -> str:
        """Open a session; its turns keep their KV between calls. Returns its id."""
        self._next_id += 1
        sid = session_id or f"sess-{self._next_id}"
        self.core.open_session(sid, tenant, priority)
        return sid

    def fork_session(self, parent_id: str, child_id: str | None = None) -> str:
        """Open a session that starts from `parent_id`'s history (sharing its cached blocks). Returns its id."""
        parent = self.sessions.get(parent_id)
        if parent is None:
            raise ValueError(f"unknown session {parent_id!r}")
        self._next_id += 1
        cid = child_id or f"sess-{self._next_id}"
        self.sessions.fork(parent, cid, self.core.clock())
        return cid

    def park(self, session_id: str, tools: tuple[str, ...] = (), expected_wait_s: float | None = None) -> None:
        """Tell the engine what a parked session waits on (tool names, expected wait)."""
        session = self.sessions.get(session_id)
        if session is None:
            raise ValueError(f"unknown session {session_id!r}")
        self.sessions.set_wait(session_id, tuple(tools), expected_wait_s)

    def get_session(self, session_id: str) -> Session | None:
        return self.sessions.get(session_id)

    def close_session(self, session_id: str) -> bool:
        return self.core.close_session(session_id)

    def update_costs(self) -> None:
        """Feed measured move bandwidths and prefill speed to the residency policy."""
        costs = self.sessions.costs
        host_s = disk_s = None
        if self.mover is not None:
            bb = self.mover.block_bytes
            bw_h = self.mover.stats.bandwidth(f"offload:{Tier.HOST.value}")
            bw_d = self.mover.stats.bandwidth(f"offload:{Tier.DISK.value}")
            host_s = bb / bw_h if bw_h else None
            disk_s = bb / bw_d if bw_d else None
        rec = self.core.prefill_s_per_token
        self.sessions.costs = MoveCosts(host_s or costs.host_s_per_block, disk_s or costs.disk_s_per_block,
                                        rec or costs.recompute_s_per_token)

    def kv_usage(self) -> dict[str, int]:
        """KV residency right now: blocks per tier and sessions per residency (a metrics sample)."""
        usage = {"device_blocks_total": self.kv.pool.num_blocks,
                 "device_blocks_used": self.kv.pool.num_used_blocks,
                 "device_blocks_cached": self.kv.pool.num_cached_blocks,
                 "device_blocks_shared": self.kv.pool.num_shared_blocks,
                 "block_bytes": self.runner.block_bytes}
        if self.mover is not None and self.mover.host is not None:
            usage["host_blocks_total"] = self.mover.host.num_blocks
            usage["host_blocks_used"] = self.mover.host.num_blocks - self.mover.host.num_free_blocks
        if self.mover is not None and self.mover.disk is not None:
            usage["disk_bytes_used"] = self.mover.disk.used_bytes
        if self.kv_store is not None:
            usage["store_bytes_used"] = self.kv_store.store.used_bytes
        if self.host_prefix_cache is not None:
            usage["host_prefix_blocks"] = len(self.host_prefix_cache)
        for residency, n in self.sessions.residency_counts().items():
            usage[f"sessions_{residency}"] = n
        return usage

    def close(self) -> None:
        """Stop the mover and release stored KV copies; write what is queued for the shared tier."""
        if self.mover is not None:
            self.mover.close()
        if self.kv_store is not None:
            self.kv_store.close()
        if self.runner._grammar_compiler is not None:
            self.runner._grammar_compiler.close()

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks. False if unknown or finished."""
        self._tracked.pop(request_id, None)
        return self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for each request that advanced or finished."""
        outputs: list[RequestOutput] = []
        if self.core.num_steps % COST_UPDATE_STEPS == 0:
            self.update_costs()
            self._heap.maybe_trim()
        for step_out in self.core.step():
            seq = step_out.seq
            tracked = self._tracked.get(seq.request_id)
            if tracked is None:
                continue
            delta = ""
            if tracked.detok is not None:
                delta = tracked.detok.add(step_out.new_token_ids, finished=seq.is_finished)
                if tracked.detok.stopped_by is not None and not seq.is_finished:
                    seq.stop_reason = tracked.detok.stopped_by
                    self.core.finish(seq.request_id, SequenceStatus.FINISHED_STOPPED)
                elif tracked.detok.stopped_by is not None:
                    seq.stop_reason = tracked.detok.stopped_by
            outputs.append(self._output(tracked, delta, step_out.new_token_ids))
            if seq.is_finished:
                del self._tracked[seq.request_id]
                if self.kv_store is not None:
                    self.kv_store.export(self._finished_block_hashes(seq))
        return outputs

    def _finished_block_hashes(self, seq: Sequence) -> list[bytes]:
        """The prefix-cache keys of a finished request's computed full blocks: the ones its session kept
        (worked out as its turns were computed), hashed afresh only for a request that kept none."""
        n = seq.num_computed_tokens
        kept = self.kv.known_block_hashes(seq.kv_successor, n) if seq.kv_successor is not None else None
        return kept if kept is not None else self.kv.block_hashes(seq.token_ids[:n], seq.salt)

    def _output(self, tracked: _Tracked, delta: str, new_ids: list[int]) -> RequestOutput:
        seq = tracked.seq
        finished = seq.is_finished
        if tracked.detok is not None:
            text = tracked.detok.text
        else:
            text = self.tokenizer.decode(seq.output_token_ids) if finished else ""
            delta = text
        reason = seq.status.value if finished else None
        if tracked.prompt_token_ids is None or len(tracked.prompt_token_ids) != seq.num_prompt_tokens:
            tracked.prompt_token_ids = seq.token_ids[:seq.num_prompt_tokens]
        return RequestOutput(
            request_id=seq.request_id, prompt=tracked.prompt, prompt_token_ids=tracked.prompt_token_ids,
            outputs=[CompletionOutput(0, text, seq.output_token_ids, reason, seq.stop_reason,
                                     # a copy: the server reads a streamed output after later steps appended
                                     None if seq.logprobs is None else list(seq.logprobs))],
            finished=finished, num_cached_tokens=seq.num_cached_tokens or 0, delta_text=delta,
            delta_token_ids=list(new_ids), arrival_s=seq.arrival_s, scheduled_s=seq.first_scheduled_s,
            first_token_s=seq.first_token_s, restore_wait_s=seq.restore_wait_s,
            finished_s=seq.finished_s, error=seq.error)
