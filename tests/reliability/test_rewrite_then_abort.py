"""A session turn aborted right after the client rewrote the history must leave the session usable.

What the server does on such a turn: the new prompt shares only a few tokens
with the session (`continue_session` cuts the history back to them, which can
release every block), the turn is added, and the client hangs up before the
first step. The session must park and take its next turn.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sessionserve import LLMEngine, SamplingParams
from sessionserve.config import Config
from sessionserve.server.turn.continuation import continue_session
from tests.engine.test_sessions import run_to_end

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_abort_after_history_rewrite_keeps_the_session_usable(tiny_llama: Path, tmp_path: Path) -> None:
    eng = LLMEngine(Config.from_kwargs(num_blocks=64, block_size=16, host_kv_bytes=0), tiny_llama)
    sid = eng.open_session("alice/s", tenant="alice")
    first = list(range(100, 140))  # 40 tokens: two full blocks, committed to the prefix index
    run_to_end(eng, eng.add_request(first, GREEDY, session_id=sid))

    rewritten = first[:3] + list(range(500, 530))  # the client rewrote everything after 3 tokens
    new, reused = continue_session(eng, sid, rewritten, "alice")
    assert reused == 3
    rid = eng.add_request(new, GREEDY, session_id=sid)
    assert eng.abort(rid)  # the client hung up before the first step

    new, _ = continue_session(eng, sid, rewritten, "alice")
    run_to_end(eng, eng.add_request(new, GREEDY, session_id=sid))
    assert eng.get_session(sid).state.value == "parked"
    eng.close_session(sid)
    eng.kv.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_rewrite_rejected_while_the_kv_moves_leaves_the_session_unchanged(tiny_llama: Path, tmp_path: Path) -> None:
    import threading
    import time

    from sessionserve.core.residency import ActionKind, ResidencyAction
    from sessionserve.core.session import Residency
    from sessionserve.types.kv_mover import Tier
    from sessionserve.core.session_manager import SessionBusyError

    eng = LLMEngine(Config.from_kwargs(num_blocks=64, block_size=16, host_kv_bytes=8 << 20,
                                       residency_policy="keep"), tiny_llama)
    sid = eng.open_session("alice/s", tenant="alice")
    first = list(range(100, 140))
    run_to_end(eng, eng.add_request(first, GREEDY, session_id=sid))
    session = eng.get_session(sid)
    eng.sessions.apply(ResidencyAction(ActionKind.OFFLOAD, sid, Tier.HOST), time.monotonic())
    for _ in range(400):
        eng.sessions.tick(time.monotonic(), 0)
        if session.residency is Residency.HOST:
            break
        time.sleep(0.005)
    release = threading.Event()
    real_read = eng.mover.host.read
    eng.mover.host.read = lambda ids: (release.wait(10), real_read(ids))[1]  # the restore is slow
    eng.sessions.apply(ResidencyAction(ActionKind.PREFETCH, sid), time.monotonic())
    assert session.residency is Residency.RESTORING
    before = (list(session.token_ids), session.num_computed_tokens)

    rewritten = first[:20] + list(range(500, 510))
    with pytest.raises(SessionBusyError):
        continue_session(eng, sid, rewritten, "alice")  # the server answers 409; the client will retry
    try:
        assert (list(session.token_ids), session.num_computed_tokens) == before
    finally:
        release.set()
        eng.close()
