"""After a turn: where the session stands, metrics and trace.

What the session waits on (the client's expected wait, the tools the reply
calls) went with the turn (`types.sequence.ParkHint`), so the residency policy
had it when the turn ended. Here the session's new point is read, so the next
turn of this conversation can continue it exactly.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from sessionserve.server.turn.continuation import point_after
from sessionserve.server.turn.types import SessionPoint

if TYPE_CHECKING:
    from sessionserve.llm_engine import RequestOutput
    from sessionserve.server.app import ModelSlot, ServerState

logger = logging.getLogger("sessionserve.requests")
_WALL_OFFSET_S = time.time() - time.monotonic()


async def park(slot: ModelSlot, key: str | None, is_whole_reply: bool = True) -> SessionPoint | None:
    """Session `key`'s point now, in the engine thread (None without a session)."""
    if key is None:
        return None
    stop_ids = tuple(slot.engine.core.eos_token_ids)
    return await slot.bridge.call(lambda e: point_after(e, key, stop_ids, is_whole_reply))


def record(state: ServerState, slot: ModelSlot, out: RequestOutput, t0: float, name: str,
           session_id: str | None, session_step: int | None) -> None:
    """The finished request in /metrics, as a trace span and as one log line."""
    ttft_s = (out.first_token_s - out.arrival_s) if out.first_token_s else None
    logger.info("%s model=%s session=%s prompt_tokens=%d cached_tokens=%d output_tokens=%d finish=%s ttft_s=%s "
                "e2e_s=%.3f", name, slot.name, session_id, len(out.prompt_token_ids), out.num_cached_tokens,
                len(out.token_ids), out.finish_reason, f"{ttft_s:.3f}" if ttft_s is not None else None,
                time.monotonic() - t0)
    state.tracer.record_request(
        name=name, request_id=out.request_id, wall_offset_s=_WALL_OFFSET_S,
        arrival_s=out.arrival_s, scheduled_s=out.scheduled_s, first_token_s=out.first_token_s,
        finished_s=out.finished_s or time.monotonic(), restore_blocked_s=out.restore_wait_s,
        attributes={"sessionserve.session_id": session_id, "sessionserve.session_step": session_step,
                    "gen_ai.usage.input_tokens": len(out.prompt_token_ids),
                    "gen_ai.usage.output_tokens": len(out.token_ids),
                    "sessionserve.cached_tokens": out.num_cached_tokens,
                    "gen_ai.response.finish_reason": out.finish_reason})
    state.metrics.record_request(
        model=slot.name, ttft_s=ttft_s,
        e2e_s=time.monotonic() - t0, num_prompt=len(out.prompt_token_ids), num_cached=out.num_cached_tokens,
        num_output=len(out.token_ids), finish_reason=out.finish_reason or "abort")
