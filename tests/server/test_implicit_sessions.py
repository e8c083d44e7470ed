"""Implicit sessions: plain OpenAI requests (no session id) continue their conversation's session."""

from __future__ import annotations

from sessionserve.server.conversation_index import ConversationIndex
from sessionserve.core.session import Session, SessionState
from sessionserve.server.implicit import ImplicitSessions, is_implicit
from tests.server.conftest import LiveServer
from tests.server.test_openai_api import TOOLS, client

SYSTEM = {"role": "system", "content": "You are a careful coding agent. " * 12}


def _implicit(server: LiveServer) -> ImplicitSessions:
    return server.app.state.ss.implicit


def _session_of(server: LiveServer, tenant: str = "alice") -> list[Session]:
    return server.call(lambda e: [s for s in e.sessions
                                  if s.tenant == tenant and is_implicit(s.session_id.split("/", 1)[1])])


def test_tool_loop_without_session_id_continues_one_session(server: LiveServer) -> None:
    c = client(server)
    imp = _implicit(server)
    hits0, opened0 = imp.num_hits, imp.num_opened
    msgs = [SYSTEM, {"role": "user", "content": "find the failing test in the parser module"}]
    first = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="required",
                                      max_tokens=120, temperature=0, extra_body={"expected_wait_s": 1.0})
    calls = first.choices[0].message.tool_calls
    assert calls and imp.num_opened == opened0 + 1
    parked = [s for s in _session_of(server) if s.stats.num_turns == 1 and s.state is SessionState.PARKED]
    assert parked, "a reply ending in tool calls parks the implicit session"
    msgs.append(first.choices[0].message.model_dump(exclude_none=True))
    msgs += [{"role": "tool", "tool_call_id": tc.id, "content": "tests/test_parser.py::test_nested FAILED"}
             for tc in calls]
    second = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=4, temperature=0)
    assert imp.num_hits == hits0 + 1 and imp.num_opened == opened0 + 1
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1, (cached, first.usage.prompt_tokens)
    assert any(s.stats.num_turns == 2 for s in _session_of(server))


def test_shared_system_prompt_branches_instead_of_continuing(server: LiveServer) -> None:
    c = client(server)
    imp = _implicit(server)
    hits0, opened0 = imp.num_hits, imp.num_opened
    a = c.chat.completions.create(model="tiny", messages=[SYSTEM, {"role": "user", "content": "task alpha"}],
                                  max_tokens=3, temperature=0)
    b = c.chat.completions.create(model="tiny", messages=[SYSTEM, {"role": "user", "content": "task beta, other"}],
                                  max_tokens=3, temperature=0)
    assert imp.num_hits == hits0 and imp.num_opened == opened0 + 2
    # The common system prompt is shared through the prefix cache, not by continuing the other conversation.
    assert b.usage.prompt_tokens_details.cached_tokens >= 16
    assert a.usage.prompt_tokens > 16


def test_explicit_session_id_wins_and_other_tenants_never_match(server: LiveServer) -> None:
    imp = _implicit(server)
    msgs = [SYSTEM, {"role": "user", "content": "tenant check"}]
    first = client(server).chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0)
    requests0, hits0 = imp.num_requests, imp.num_hits
    client(server).chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0,
                                           extra_headers={"X-Session-ID": "explicit-1"})
    assert imp.num_requests == requests0  # an explicit id bypasses detection
    follow = msgs + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "and then?"}]
    client(server, key="key-bob").chat.completions.create(model="tiny", messages=follow, max_tokens=3, temperature=0)
    assert imp.num_hits == hits0  # bob's identical conversation does not continue alice's session


def test_implicit_sessions_do_not_use_the_explicit_session_limit(server: LiveServer) -> None:
    c = client(server)
    for i in range(3):
        c.chat.completions.create(model="tiny", messages=[SYSTEM, {"role": "user", "content": f"one-off {i}"}],
                                  max_tokens=2, temperature=0)
    # Ids with the implicit marker cannot be chosen by clients: the server maps them to valid ids.
    r = c.chat.completions.with_raw_response.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                    max_tokens=2, extra_headers={"X-Session-ID": "~abc"})
    assert r.headers["x-session-id"].startswith("_abc-")


# -- pure parts, with a stand-in engine ----------------------------------------------------------------


class _Engine:
    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.closed: list[str] = []

    def get_session(self, key: str) -> Session | None:
        return self.sessions.get(key)

    def close_session(self, key: str) -> bool:
        self.closed.append(key)
        return self.sessions.pop(key, None) is not None

    def turn(self, key: str, tenant: str, tokens: list[int], state: SessionState = SessionState.PARKED) -> None:
        s = self.sessions.setdefault(key, Session(key, tenant=tenant))
        s.token_ids, s.state = list(tokens), state


def test_index_matches_only_a_whole_indexed_prompt_longest_first() -> None:
    idx = ConversationIndex(block_size=4)
    idx.register("t/a", list(range(10)))  # full blocks [0..8)
    idx.register("t/b", list(range(14)))  # full blocks [0..12)
    assert list(idx.candidates(list(range(20)))) == [("t/b", 14), ("t/a", 10)]
    assert list(idx.candidates(list(range(9)) + [99, 98, 97])) == [("t/a", 10)]  # caller checks the tail
    assert list(idx.candidates(list(range(7)))) == []  # shorter than what any session holds
    assert list(idx.candidates(list(range(20)), salt=b"other")) == []
    idx.register("t/a", list(range(30)))  # re-indexed under its new prompt
    assert [k for k, _ in idx.candidates(list(range(16)))] == ["t/b"]
    idx.forget("t/b")
    assert list(idx.candidates(list(range(16)))) == [] and len(idx) == 1


def test_resolve_continues_forks_when_busy_and_evicts_lru() -> None:
    eng = _Engine()
    imp = ImplicitSessions(block_size=4, max_sessions=2)
    prompt = list(range(12))
    sid = imp.resolve(eng, "t", prompt, b"")
    eng.turn(f"t/{sid}", "t", prompt + [50, 51])
    longer = prompt + [50, 51, 60, 61]
    assert imp.resolve(eng, "t", longer, b"") == sid and imp.num_hits == 1
    eng.turn(f"t/{sid}", "t", longer, SessionState.RUNNING)
    # Same context while that turn runs (a sub-agent): a fork, not the running session.
    child = imp.resolve(eng, "t", longer + [70, 71], b"")
    assert child != sid and imp.num_forks == 1
    eng.turn(f"t/{child}", "t", longer + [70, 71, 5])
    eng.sessions[f"t/{sid}"].state = SessionState.PARKED
    # A tail that differs from the indexed prompt inside its last partial block: not a continuation.
    other = imp.resolve(eng, "t", list(range(12)) + [50, 99, 60, 61, 1, 2], b"")
    assert other not in (sid, child)
    assert eng.closed == [f"t/{sid}"]  # max 2: the least recently used idle one was closed
    assert imp.num_evicted == 1 and imp.num_open == 2


def test_resolve_checks_the_indexed_prompts_partial_tail() -> None:
    eng = _Engine()
    imp = ImplicitSessions(block_size=4)
    prompt = list(range(14))  # 3 full blocks and a tail of 2
    sid = imp.resolve(eng, "t", prompt, b"")
    eng.turn(f"t/{sid}", "t", prompt + [40])
    assert imp.resolve(eng, "t", list(range(13)) + [77, 78, 79], b"") != sid
    assert imp.resolve(eng, "t", prompt + [40, 41], b"") == sid


def test_find_is_repeatable_until_the_turn_is_committed() -> None:
    # A turn refused while its session's KV moves between tiers is added again later: the retry must find
    # the same session, not a new one (the index learns the new prompt only once the turn was added).
    eng = _Engine()
    imp = ImplicitSessions(block_size=4)
    prompt = list(range(12))
    sid = imp.resolve(eng, "t", prompt, b"")
    eng.turn(f"t/{sid}", "t", prompt + [50, 51])
    longer = prompt + [50, 51, 60, 61]
    assert imp.find(eng, "t", longer, b"") == (sid, "hit")
    assert imp.find(eng, "t", longer, b"") == (sid, "hit") and imp.num_hits == 0
    imp.commit(eng, "t", sid, "hit", longer, b"")
    assert imp.num_hits == 1 and imp.num_opened == 1 and imp.num_requests == 2


def test_fork_via_sessions_api_shares_the_parents_blocks(server: LiveServer) -> None:
    import httpx

    auth = {"Authorization": "Bearer key-alice"}
    c = client(server)
    msgs = [SYSTEM, {"role": "user", "content": "plan the refactor, then split the work"}]
    first = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                      extra_headers={"X-Session-ID": "parent-1"})
    r = httpx.post(server.url + "/v1/sessions/parent-1/fork", json={"session_id": "child-1"}, headers=auth)
    assert r.status_code == 200 and r.json()["forked_from"] == "parent-1"
    parent_info = httpx.get(server.url + "/v1/sessions/parent-1", headers=auth).json()
    assert r.json()["num_tokens"] == parent_info["num_tokens"] and r.json()["num_computed_tokens"] == 0
    history = msgs + [{"role": "assistant", "content": first.choices[0].message.content}]
    child = c.chat.completions.create(model="tiny", messages=history + [{"role": "user", "content": "part A"}],
                                      max_tokens=3, temperature=0, extra_headers={"X-Session-ID": "child-1"})
    # The child's first turn prefilled only what the parent's full blocks do not cover.
    assert child.usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens // 16) * 16
    parent = c.chat.completions.create(model="tiny", messages=history + [{"role": "user", "content": "part B"}],
                                       max_tokens=3, temperature=0, extra_headers={"X-Session-ID": "parent-1"})
    assert parent.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert httpx.post(server.url + "/v1/sessions/nope/fork", json={}, headers=auth).status_code == 404
    assert httpx.post(server.url + "/v1/sessions/parent-1/fork", json={"session_id": "child-1"},
                      headers=auth).status_code == 409
    bob = {"Authorization": "Bearer key-bob"}
    assert httpx.post(server.url + "/v1/sessions/parent-1/fork", json={}, headers=bob).status_code == 404
    for sid in ("parent-1", "child-1"):
        httpx.delete(server.url + f"/v1/sessions/{sid}", headers=auth)


def test_completions_find_their_conversation_when_enabled(tiny_llama) -> None:  # noqa: ANN001
    import httpx

    from sessionserve import LLMEngine
    from sessionserve.config import Config
    from sessionserve.server.app import create_app
    from sessionserve.server.auth import Auth
    from tests.server.conftest import KEYS, run_app

    engine = LLMEngine(Config.from_kwargs(num_blocks=128, block_size=16, max_num_seqs=4), tiny_llama)
    app = create_app(engine, model_name="tiny", auth=Auth(KEYS), implicit_sessions="all")
    auth = {"Authorization": "Bearer key-alice"}
    with run_app(app) as url:
        def complete(prompt: list[int]) -> dict:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            return httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=60).json()

        prompt = list(range(100, 160))
        first = complete(prompt)
        history = prompt + first["choices"][0]["token_ids"]
        second = complete(history + list(range(300, 320)))
        # The second call continued the first's session: only the new tokens were prefilled.
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history) - 1
        imp = app.state.ss.implicit
        assert imp.num_hits == 1 and imp.num_opened == 1
        other = complete(list(range(100, 140)) + list(range(900, 930)))  # shares a prefix only: its own session
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32 and imp.num_opened == 2
