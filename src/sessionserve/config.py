"""Every knob of sessionserve in one place: frozen dataclasses per layer.

Components receive the sub-config (or the few values) they use, never the whole
`Config`. Environment variables are read only in `Config.from_env`, never at
import time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

MiB = 1 << 20
GiB = 1 << 30

# The values of SchedulerConfig.scheduling_policy and .scheduling_order (core/priority.py says what each does).
SCHEDULING_POLICIES = ("fcfs", "priority")
SCHEDULING_ORDERS = ("program", "request")
ADMISSION_MODES = ("auto", "working-set", "off")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache on the device tier."""

    # Tokens per KV block. 16 matches vLLM's default: small enough that a
    # partly filled last block wastes little, large enough that block tables
    # stay short and prefix hashing is cheap.
    block_size: int = 16
    # Device-tier KV budget in bytes. On CPU this is ordinary RAM set aside for
    # attention; 1 GiB holds ~20k tokens of the `small` model in fp32.
    kv_cache_bytes: int = 1 * GiB
    # Explicit block count; overrides kv_cache_bytes when set (tests use it to
    # make memory pressure deterministic).
    num_blocks: int | None = None
    # Share full blocks between requests by a chained hash of their tokens.
    enable_prefix_caching: bool = True
    # Host memory for blocks the device's prefix cache evicts (a second level, by hash): a preempted or
    # returning request gets them back instead of recomputing them. 0 disables it.
    host_prefix_cache_bytes: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.host_prefix_cache_bytes < 0:
            raise ValueError(f"host_prefix_cache_bytes must be >= 0, got {self.host_prefix_cache_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits for one engine step."""

    # Most sequences in one step. Bounds the decode batch (and its memory for
    # logits) and the Python work per step.
    max_num_seqs: int = 64
    # Most tokens (prefill chunks + decode tokens) in one step. Long prompts are
    # split into chunks of at most this many tokens, so decode keeps flowing.
    max_num_batched_tokens: int = 2048
    # Longest prompt + output a sequence may reach, in tokens. None: the model's
    # max_position_embeddings.
    max_model_len: int | None = None
    # Split prompts longer than the remaining step budget across steps.
    enable_chunked_prefill: bool = True
    # "priority": interactive before batch, least attained service per session,
    # aging (core/priority.py). "fcfs": arrival order, as request-level servers do.
    scheduling_policy: str = "priority"
    # Within a class: "program" = in the order sessions started (an agent's next step before later agents'
    # first steps), "request" = in the order requests arrived (see core/priority.py).
    scheduling_order: str = "program"
    # Least attained service per session: tokens per service level; 0 = off (see core/priority.py).
    las_quantum_tokens: int = 0
    aging_s: float = 5.0
    starvation_s: float = 30.0
    # An interactive turn kept waiting this long by memory or batch slots preempts batch work.
    preempt_after_s: float = 0.5
    # Session admission by working set (core/admission.py): "working-set" holds new sessions at the door
    # while the active admitted sessions' contexts fill `admission_fill` of the device KV, so returning
    # turns keep their KV instead of thrashing; "auto" does so only while recomputing a session's context
    # costs more engine time than an agent's tool wait (measured; where it does not, holding would only
    # idle the engine); "off": every request is scheduled as it comes. Each session is counted at the
    # context sessions typically reach, which overstates the working set at any moment (they do not all
    # peak together): 1.2 was best of 0.9 / 1.2 / 1.6 on the simulated weka_claude_code sweep in
    # bench/RESULTS.md.
    admission: str = "auto"
    admission_fill: float = 1.2
    # A parked admitted session stops counting after max(this, 3 x its expected wait) idle: agents come back
    # within seconds of a tool call, and one that finished rarely says so.
    admission_hold_s: float = 5.0
    # A new session's turn that must wait at the door: "hold" it until it is let in (its request stays
    # open), or "reject" it at once (HTTP 429 with Retry-After: when an admitted session is expected to
    # leave), for clients that would rather retry or go elsewhere.
    admission_when_full: str = "hold"
    # While interactive turns run, background prefill gets at most this many tokens per step, so
    # interactive turns stream at decode pace (see core/priority.py). None: 1/16 of
    # max_num_batched_tokens (at least 1); 0: no limit.
    background_prefill_tokens: int | None = None
    # While running sequences decode, the prompt chunks batched with them take at most about this many
    # seconds of a step (from the measured prefill cost per token): one tenant's long prompt then delays
    # every stream's next token by about this, not by a whole max_num_batched_tokens chunk (seconds on a
    # CPU), paid in that prompt's time to first token. None: only max_num_batched_tokens bounds them.
    max_prefill_step_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; "
                             f"got {self.scheduling_policy!r}")
        if self.scheduling_order not in SCHEDULING_ORDERS:
            raise ValueError(f"scheduling_order must be one of {', '.join(SCHEDULING_ORDERS)}; "
                             f"got {self.scheduling_order!r}")
        if self.las_quantum_tokens < 0 or self.aging_s <= 0 or self.starvation_s <= 0 or self.preempt_after_s < 0:
            raise ValueError("las_quantum_tokens >= 0, aging_s > 0, starvation_s > 0, preempt_after_s >= 0")
        if self.background_prefill_tokens is not None and self.background_prefill_tokens < 0:
            raise ValueError(f"background_prefill_tokens must be >= 0, got {self.background_prefill_tokens}")
        if self.max_prefill_step_s is not None and self.max_prefill_step_s <= 0:
            raise ValueError(f"max_prefill_step_s must be > 0, got {self.max_prefill_step_s}")
        if self.admission not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {', '.join(ADMISSION_MODES)}, got {self.admission!r}")
        if self.admission_when_full not in ("hold", "reject"):
            raise ValueError(f"admission_when_full must be hold or reject, got {self.admission_when_full!r}")
        if not 0 < self.admission_fill <= 4:
            raise ValueError(f"admission_fill must be in (0, 4], got {self.admission_fill}")

    @property
    def resolved_background_prefill_tokens(self) -> int:
        if self.background_prefill_tokens is None:
            return max(1, self.max_num_batched_tokens // 16)
        return self.background_prefill_tokens


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how to run them."""

    # A Hugging Face model folder (config.json + *.safetensors + tokenizer).
    # None: the embedded default, created on first use.
    model: str | None = None
    # "auto": bfloat16 on CUDA; on CPU bfloat16 where the CPU has native bf16
    # dot products (AVX-512 BF16 / AMX) and the weights are not float32-only, else float32.
    dtype: str = "auto"
    # "auto": CUDA when available, else CPU.
    device: str = "auto"
    # On CPU, re-lay out every linear weight once for oneDNN at load time
    # (model/packed_linear.py); off: plain F.linear (MKL).
    pack_weights: bool = True
    # Intra-op threads for torch on CPU. None: leave torch's default.
    num_threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")


@dataclass(frozen=True)
class SessionConfig:
    """Sessions and the KV tiers below the device."""

    # What happens to a parked session's KV: discard | keep | ttl | least-waste | predictive.
    residency_policy: str = "predictive"
    # Host-tier budget in bytes (CPU memory; pinned on CUDA). 0 disables the tier.
    host_kv_bytes: int = 2 * GiB
    # Store host-tier KV as int8 with per-block scales: ~4x the sessions per byte,
    # at a small logit error (measured in tests/engine/test_sessions.py).
    host_kv_int8: bool = False
    # Disk-tier budget in bytes. 0 disables the tier.
    disk_kv_bytes: int = 0
    # Spool folder for the disk tier. None: a fresh folder under the system temp dir.
    spool_dir: str | None = None
    # A folder that replicas share (local disk for replicas of one machine, or a network file system):
    # finished requests' KV blocks are written there, and a request whose prefix is not on the device
    # loads it from there. A session whose replica died continues elsewhere without recompute.
    # None disables it.
    kv_store_dir: str | None = None
    # Budget of the shared folder in bytes (least recently used blocks are removed past it).
    kv_store_bytes: int = 8 * GiB
    # Close sessions idle (parked, no turn) longer than this, freeing all their KV.
    session_idle_ttl_s: float = 600.0
    max_sessions: int = 10_000

    def __post_init__(self) -> None:
        if self.host_kv_bytes < 0 or self.disk_kv_bytes < 0:
            raise ValueError("tier budgets must be >= 0")
        if self.kv_store_bytes < 1:
            raise ValueError("kv_store_bytes must be positive")
        if self.session_idle_ttl_s <= 0:
            raise ValueError("session_idle_ttl_s must be positive")
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: proposed tokens verified by the model in one forward (core/spec.py)."""

    # "none" | "ngram": prompt lookup in the sequence's own context, no second model |
    # "draft": a smaller model with the same tokenizer (`draft_model`) proposes.
    speculative_method: str = "none"
    # Most tokens proposed per sequence per step.
    num_speculative_tokens: int = 4
    # Fewer tokens (down to none) for sequences whose drafts are seldom accepted.
    spec_adaptive: bool = True
    # Prompt lookup: the longest and shortest context suffix to look up.
    ngram_max: int = 4
    ngram_min: int = 1
    # Draft model folder (HF format, same vocabulary as the target).
    draft_model: str | None = None
    # The draft model's own KV budget (it keeps the context of every drafting sequence).
    draft_kv_cache_bytes: int = 256 * MiB
    # The draft model's compute dtype; None: the target's. Its precision changes only which tokens it
    # proposes, never the output (the target verifies every one), and a small draft's step is bound by
    # reading its weights: bfloat16 halves that.
    draft_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.speculative_method not in ("none", "ngram", "draft"):
            raise ValueError(f"speculative_method must be none|ngram|draft, got {self.speculative_method!r}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"num_speculative_tokens must be in [1, 32], got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.speculative_method == "draft" and not self.draft_model:
            raise ValueError("speculative_method 'draft' needs draft_model (a model folder)")
        if self.draft_kv_cache_bytes <= 0:
            raise ValueError("draft_kv_cache_bytes must be positive")
        if self.draft_dtype not in (None, "auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"draft_dtype must be auto|float32|bfloat16|float16, got {self.draft_dtype!r}")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server around the engines: limits per request and per tenant, sessions found by content,
    stored Responses API responses."""

    # Requests in flight (queued or running) per engine; past it a new request gets 429 with Retry-After.
    max_queued_requests: int = 1024
    # Largest request body in bytes (413 past it): 4 MiB holds a long agent conversation with its tools (about
    # a million tokens of text), and decoding one (a GIL hold of ~0.3 s at worst) stays short for everyone else.
    max_request_bytes: int = 4 * MiB
    # Sessions a tenant may open by id (sessions found by content do not count; 429 past it).
    max_sessions_per_tenant: int = 1000
    # Generation requests one tenant may have in flight at once (429 past it).
    max_requests_per_tenant: int = 256
    # Requests without a session id continue the session of the conversation they extend: "chat" (chat,
    # Responses and Messages turns), "all" (raw completions too), "off".
    implicit_sessions: str = "chat"
    # Sessions found by content kept at most (the least recently used idle one is closed past it).
    max_implicit_sessions: int = 256
    # Threads that render chat templates and tokenize, off the event loop and the engine thread.
    tokenize_threads: int = 2
    # Where Responses API responses are stored for previous_response_id: None (SQLite in memory),
    # "sqlite:///file.db", "redis://host:port/db" (shared by replicas), "memory://".
    response_store: str | None = None
    # How long a stored response can be continued or read back, in seconds.
    response_ttl_s: float = 24 * 3600.0
    # Deepest nesting of lists and objects a request body may have (400 past it). What reads a body
    # after the JSON parser recurses too (validation, chat templates, JSON schema -> grammar); 128 levels
    # hold any real tool schema.
    max_json_depth: int = 128
    # Who may read /metrics and the API description (/openapi.json, /docs, /redoc): "none" (anyone, as
    # Prometheus scrapers expect; the default) or "key" (a valid API key, as /v1/ needs).
    metrics_auth: str = "none"

    def __post_init__(self) -> None:
        if self.implicit_sessions not in ("chat", "all", "off"):
            raise ValueError(f"implicit_sessions must be chat, all or off, not {self.implicit_sessions!r}")
        if self.metrics_auth not in ("none", "key"):
            raise ValueError(f"metrics_auth must be none or key, not {self.metrics_auth!r}")
        for name in ("max_queued_requests", "max_request_bytes", "max_sessions_per_tenant",
                     "max_requests_per_tenant", "max_implicit_sessions", "tokenize_threads", "max_json_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.response_ttl_s <= 0:
            raise ValueError("response_ttl_s must be positive")


@dataclass(frozen=True)
class Config:
    """The whole engine configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    session: SessionConfig = field(default_factory=SessionConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> Config:
        """Build a Config from flat keyword arguments (`block_size=16, num_threads=2`).

        Each name must belong to exactly one sub-config; unknown names raise.
        """
        parts: dict[str, dict[str, Any]] = {part: {} for part in _PARTS}
        owners = {f.name: part for part, klass in _PARTS.items() for f in fields(klass)}
        for name, value in kwargs.items():
            if name not in owners:
                raise TypeError(f"unknown engine option {name!r}")
            parts[owners[name]][name] = value
        return cls(**{part: klass(**parts[part]) for part, klass in _PARTS.items()})

    @classmethod
    def from_env(cls, base: Config | None = None, environ: dict[str, str] | None = None) -> Config:
        """Overlay SESSIONSERVE_* variables (e.g. SESSIONSERVE_KV_CACHE_BYTES) on `base`."""
        env = os.environ if environ is None else environ
        config = base or cls()
        subs = {part: getattr(config, part) for part in _PARTS}
        for part, sub in list(subs.items()):
            updates: dict[str, Any] = {}
            for f in fields(sub):
                raw = env.get(f"SESSIONSERVE_{f.name.upper()}")
                if raw is not None:
                    updates[f.name] = _parse(raw, getattr(sub, f.name))
            if updates:
                subs[part] = replace(sub, **updates)
        return cls(**subs)


def fold_cpu_host_tier(config: Config, device_type: str) -> tuple[Config, str | None]:
    """On a CPU the host tier is the same RAM as the device KV: a full-precision copy there holds no more
    tokens than the device would, and every session moved there must come back into device blocks that
    running turns are using. So its bytes join the device KV, where running turns and parked sessions can
    both use them. Kept as a tier where it holds more per byte (`host_kv_int8`). Returns the config to
    build and a line saying what was done (None when nothing was)."""
    sc = config.session
    if device_type != "cpu" or not sc.host_kv_bytes or sc.host_kv_int8 or config.cache.num_blocks is not None:
        return config, None
    total = config.cache.kv_cache_bytes + sc.host_kv_bytes
    note = (f"host tier: on a CPU it is the same RAM as the device KV, so its {sc.host_kv_bytes:,} bytes are "
            f"added to the device KV ({total:,} bytes); keep it as a tier with --host-kv-int8, which stores ~4x "
            f"the tokens per byte")
    return replace(config, cache=replace(config.cache, kv_cache_bytes=total),
                   session=replace(sc, host_kv_bytes=0)), note


_PARTS: dict[str, type] = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                           "session": SessionConfig, "speculative": SpeculativeConfig}


def _parse(raw: str, current: Any) -> Any:
    if isinstance(current, bool):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(current, int):
        return int(raw)
    if isinstance(current, float):
        return float(raw)
    if current is None and raw.strip().lstrip("-").isdigit():
        return int(raw)
    return raw
