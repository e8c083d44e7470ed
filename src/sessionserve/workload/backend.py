"""What the replay driver needs from a server: the `Backend` protocol and what one step returns.

Two implementations: `InprocBackend` (inproc.py, the engine API in this
process) and `HttpBackend` (http_backend.py, any OpenAI-compatible server).
All methods are coroutines called from one asyncio loop; none blocks it.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol


class StepResult(NamedTuple):
    """One finished LLM step, timed by the backend (seconds, its own monotonic clock)."""

    output_token_ids: list[int]
    latency_s: float  # request sent -> last token
    ttft_s: float | None  # request sent -> first token; None if not observable
    tpot_s: float | None  # mean time per output token after the first; None with < 2 tokens
    num_prompt_tokens: int  # the whole prompt the server saw (context + new)
    num_cached_tokens: int  # prompt tokens the server did not prefill; 0 if not reported


class Backend(Protocol):
    """A server the replay drives, one agent session at a time per session id.

    Contract: `open_session` before the first `generate` of a session id,
    `close_session` after its last; `generate` calls of one session never
    overlap. Session stats and KV samples are best effort: empty if the server
    does not expose them.
    """

    name: str
    vocab_size: int  # token ids sent are < this

    async def start(self) -> None:
        """Connect or start the engine loop; call once before anything else."""

    async def stop(self) -> None:
        """Release what `start` took; outstanding requests are abandoned."""

    async def open_session(self, session_id: str, priority: str = "interactive") -> None:
        """Begin a session with an empty context, in scheduling class `priority` (interactive | batch)."""

    async def generate(self, session_id: str, step_index: int, new_token_ids: list[int], max_tokens: int,
                       context_kept_tokens: int | None = None) -> StepResult:
        """Send one step: the session's context (cut to `context_kept_tokens` first, if given) plus
        `new_token_ids`; generate exactly `max_tokens` tokens greedily. The output joins the context."""

    async def park(self, session_id: str, tools: tuple[str, ...], expected_wait_s: float | None) -> None:
        """Tell the server the session now waits on `tools` (a hint; may be a no-op)."""

    async def close_session(self, session_id: str) -> dict[str, float]:
        """End the session; return its server-side counters (SessionStats field names), or {}."""

    def kv_usage(self) -> dict[str, int] | None:
        """Latest KV residency sample (bytes per tier, sessions per residency), or None if unknown."""

    def busy_s(self) -> float | None:
        """Seconds the server spent stepping with work since `start`, or None if unknown."""
