"""Sessions on a tiny model: continuity across every residency, and nothing leaked."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from sessionserve import LLMEngine, SamplingParams
from sessionserve.config import Config
from sessionserve.core.residency import ActionKind, ResidencyAction
from sessionserve.core.session import Residency
from sessionserve.obs.cpu_roles import release_compute_threads
from sessionserve.types.kv_mover import Tier

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def turns(seed: int, n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(50, 16000, (int(k),), generator=g).tolist() for k in torch.randint(5, 40, (n,), generator=g)]


def make_engine(path: Path, tmp_path: Path, **kwargs) -> LLMEngine:
    opts = dict(num_blocks=96, block_size=16, residency_policy="keep", host_kv_bytes=64 << 20,
                disk_kv_bytes=64 << 20, spool_dir=str(tmp_path / "spool"))
    opts.update(kwargs)
    return LLMEngine(Config.from_kwargs(**opts), path)


def run_to_end(eng: LLMEngine, rid: str) -> list[int]:
    for _ in range(500):
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return out.token_ids
    raise AssertionError("request did not finish")


def settle(eng: LLMEngine, sid: str, want: set[Residency]) -> None:
    for _ in range(400):
        eng.sessions.tick(time.monotonic(), 0)
        if eng.get_session(sid).residency in want:
            return
        time.sleep(0.005)
    raise AssertionError(f"residency stuck at {eng.get_session(sid).residency}")


def move(eng: LLMEngine, sid: str, mode: str) -> None:
    now = time.monotonic()
    if mode == "keep":
        return
    if mode == "drop":
        eng.sessions.apply(ResidencyAction(ActionKind.DROP, sid), now)
        assert eng.get_session(sid).residency is Residency.NONE
        return
    tier = Tier.DISK if mode == "disk" else Tier.HOST
    eng.sessions.apply(ResidencyAction(ActionKind.OFFLOAD, sid, tier), now)
    settle(eng, sid, {Residency.HOST, Residency.DISK})
    if mode.endswith("prefetch"):
        eng.sessions.apply(ResidencyAction(ActionKind.PREFETCH, sid), time.monotonic())
        settle(eng, sid, {Residency.DEVICE})


def run_session(eng: LLMEngine, seed: int, mode: str) -> list[list[int]]:
    sid = eng.open_session()
    outs = []
    for new in turns(seed):
        rid = eng.add_request(new, GREEDY, session_id=sid)
        outs.append(run_to_end(eng, rid))
        eng.park(sid, tools=("search",), expected_wait_s=1.0)
        move(eng, sid, mode)
    assert eng.close_session(sid)
    return outs


def assert_clean(eng: LLMEngine) -> None:
    eng.sessions.tick(time.monotonic(), 0)
    eng.kv.check_integrity()
    assert not eng.kv.block_tables
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    if eng.mover is not None:
        assert eng.mover.num_stored == 0
        if eng.mover.host is not None:
            eng.mover.host.check_integrity()
            assert eng.mover.host.num_free_blocks == eng.mover.host.num_blocks
        if eng.mover.disk is not None:
            assert eng.mover.disk.used_bytes == 0 and eng.mover.disk.num_files == 0


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, tmp_path_factory) -> list[list[int]]:
    eng = make_engine(tiny_llama, tmp_path_factory.mktemp("ref"), host_kv_bytes=0, disk_kv_bytes=0)
    return run_session(eng, 11, "keep")


@pytest.mark.parametrize("mode", ["keep", "drop", "host", "host-prefetch", "disk", "disk-prefetch"])
def test_outputs_identical_whatever_the_residency(tiny_llama: Path, tmp_path: Path, reference, mode: str) -> None:
    eng = make_engine(tiny_llama, tmp_path)
    assert run_session(eng, 11, mode) == reference
    assert_clean(eng)
    eng.close()


def test_the_mover_lets_its_compute_threads_go_each_time_it_runs_out_of_jobs(tiny_llama: Path,
                                                                             tmp_path: Path) -> None:
    """Its copies start OpenMP threads of its own; kept, they would stop the engine thread's from spinning."""
    eng = make_engine(tiny_llama, tmp_path)
    assert eng.mover.when_idle is release_compute_threads
    idle_calls: list[float] = []
    eng.mover.when_idle = lambda: idle_calls.append(time.monotonic())
    run_session(eng, 11, "disk-prefetch")  # three turns: an offload and a restore after each
    assert len(idle_calls) >= 3  # after each move at least (a restore queued behind an offload: after both)
    assert_clean(eng)
    eng.close()


def test_session_equals_one_shot_generation(tiny_llama: Path, tmp_path: Path, reference) -> None:
    """A session's last turn equals a stateless request carrying the whole history."""
    eng = make_engine(tiny_llama, tmp_path, enable_prefix_caching=False)
    history: list[int] = []
    for new, out in zip(turns(11), reference):
        history += new
        rid = eng.add_request(list(history), GREEDY)
        assert run_to_end(eng, rid) == out
        history += out


def test_new_turn_prefills_only_new_tokens(tiny_llama: Path, tmp_path: Path) -> None:
    eng = make_engine(tiny_llama, tmp_path, enable_prefix_caching=False)
    sid = eng.open_session()
    ts = turns(12)
    for new in ts:
        rid = eng.add_request(new, GREEDY, session_id=sid)
        run_to_end(eng, rid)
    stats = eng.get_session(sid).stats
    # Each turn prefills its new tokens plus the previous turn's last sampled token.
    assert stats.num_computed_prompt_tokens == sum(len(t) for t in ts) + (len(ts) - 1)
    assert stats.num_recompute_tokens == 0


def test_dropped_session_counts_recompute(tiny_llama: Path, tmp_path: Path) -> None:
    eng = make_engine(tiny_llama, tmp_path, enable_prefix_caching=False, residency_policy="discard")
    sid = eng.open_session()
    for new in turns(13):
        run_to_end(eng, eng.add_request(new, GREEDY, session_id=sid))
    assert eng.get_session(sid).stats.num_recompute_tokens > 0


def test_int8_host_tier_logit_error_is_bounded(tiny_llama: Path, tmp_path: Path, reference) -> None:
    eng = make_engine(tiny_llama, tmp_path, host_kv_int8=True)
    outs = run_session(eng, 11, "host")
    # int8 KV changes logits slightly; on a random-weight model the greedy path may still match.
    agree = sum(a == b for x, y in zip(outs, reference) for a, b in zip(x, y)) / sum(len(x) for x in reference)
    assert agree >= 0.6
    assert_clean(eng)


def test_corrupt_disk_copy_falls_back_to_recompute(tiny_llama: Path, tmp_path: Path, reference) -> None:
    eng = make_engine(tiny_llama, tmp_path)
    sid = eng.open_session()
    ts = turns(11)
    outs = [run_to_end(eng, eng.add_request(ts[0], GREEDY, session_id=sid))]
    move(eng, sid, "disk")
    for path in (tmp_path / "spool").glob("*.kv"):
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))
    for new in ts[1:]:
        outs.append(run_to_end(eng, eng.add_request(new, GREEDY, session_id=sid)))
    assert outs == reference
    assert eng.sessions.num_corrupt_restores == 1
    eng.close_session(sid)
    assert_clean(eng)


def test_idle_sessions_expire_and_free_everything(tiny_llama: Path, tmp_path: Path) -> None:
    eng = make_engine(tiny_llama, tmp_path, session_idle_ttl_s=600)
    sids = [eng.open_session() for _ in range(3)]
    for sid, new in zip(sids, turns(14)):
        run_to_end(eng, eng.add_request(new, GREEDY, session_id=sid))
    move(eng, sids[0], "host")
    move(eng, sids[1], "disk")
    eng.sessions.idle_ttl_s = 0.05
    time.sleep(0.1)
    eng.sessions.tick(time.monotonic(), 0)
    assert eng.sessions.num_expired == 3 and not list(eng.sessions)
    assert_clean(eng)


def test_abort_mid_turn_keeps_the_session_usable(tiny_llama: Path, tmp_path: Path) -> None:
    eng = make_engine(tiny_llama, tmp_path)
    sid = eng.open_session()
    ts = turns(15)
    run_to_end(eng, eng.add_request(ts[0], GREEDY, session_id=sid))
    rid = eng.add_request(ts[1], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), session_id=sid)
    eng.step()
    eng.step()
    assert eng.abort(rid)
    run_to_end(eng, eng.add_request(ts[2], GREEDY, session_id=sid))
    eng.close_session(sid)
    assert_clean(eng)


def test_session_errors(tiny_llama: Path, tmp_path: Path) -> None:
    eng = make_engine(tiny_llama, tmp_path)
    with pytest.raises(ValueError, match="unknown session"):
        eng.add_request([1, 2, 3], GREEDY, session_id="nope")
    sid = eng.open_session("s1")
    with pytest.raises(ValueError, match="already exists"):
        eng.open_session("s1")
    eng.add_request([5, 6, 7], GREEDY, session_id=sid)
    with pytest.raises(ValueError, match="already has a turn"):
        eng.add_request([8], GREEDY, session_id=sid)
    eng.close_session(sid)
    assert_clean(eng)


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.DISK])
def test_close_or_resume_mid_move_leaks_nothing(tiny_llama: Path, tmp_path: Path, tier: Tier) -> None:
    eng = make_engine(tiny_llama, tmp_path)
    ts = turns(16)
    # Closed while offloading.
    a = eng.open_session()
    run_to_end(eng, eng.add_request(ts[0], GREEDY, session_id=a))
    eng.sessions.apply(ResidencyAction(ActionKind.OFFLOAD, a, tier), time.monotonic())
    assert eng.get_session(a).residency is Residency.OFFLOADING
    eng.close_session(a)
    # Closed while restoring.
    b = eng.open_session()
    run_to_end(eng, eng.add_request(ts[1], GREEDY, session_id=b))
    move(eng, b, "disk" if tier is Tier.DISK else "host")
    eng.sessions.apply(ResidencyAction(ActionKind.PREFETCH, b), time.monotonic())
    assert eng.get_session(b).residency is Residency.RESTORING
    eng.close_session(b)
    # Resumed while offloading: keeps the device copy, output unchanged.
    c = eng.open_session()
    first = run_to_end(eng, eng.add_request(ts[0], GREEDY, session_id=c))
    eng.sessions.apply(ResidencyAction(ActionKind.OFFLOAD, c, tier), time.monotonic())
    second = run_to_end(eng, eng.add_request(ts[1], GREEDY, session_id=c))
    # Aborted while its KV is being restored: the session stays usable.
    move(eng, c, "disk" if tier is Tier.DISK else "host")
    rid = eng.add_request(ts[2], GREEDY, session_id=c)
    assert eng.abort(rid)
    third = run_to_end(eng, eng.add_request(ts[2], GREEDY, session_id=c))
    ref = make_engine(tiny_llama, tmp_path / "ref", host_kv_bytes=0, disk_kv_bytes=0)
    r = ref.open_session()
    assert [run_to_end(ref, ref.add_request(t, GREEDY, session_id=r)) for t in ts[:3]] == [first, second, third]
    eng.close_session(c)
    # Cut back (the client rewrote its history) while offloading: the copy out is cancelled and the device
    # copy cut at once; no wait, no error, output unchanged.
    d = eng.open_session()
    d_first = run_to_end(eng, eng.add_request(ts[0] + ts[1], GREEDY, session_id=d))
    eng.sessions.apply(ResidencyAction(ActionKind.OFFLOAD, d, tier), time.monotonic())
    assert eng.get_session(d).residency is Residency.OFFLOADING
    eng.sessions.truncate(eng.get_session(d), len(ts[0]))
    assert eng.get_session(d).residency is Residency.DEVICE
    assert run_to_end(eng, eng.add_request(ts[1], GREEDY, session_id=d)) == d_first
    eng.close_session(d)
    for _ in range(400):
        eng.sessions.tick(time.monotonic(), 0)
        if not eng.sessions.num_moves_pending:
            break
        time.sleep(0.005)
    assert_clean(eng)


def run_many(eng: LLMEngine, num_sessions: int, seed: int) -> dict[int, list[list[int]]]:
    """Interleaved sessions: every session takes a turn, all park, then the next round."""
    sids = [eng.open_session() for _ in range(num_sessions)]
    all_turns = [turns(seed + i) for i in range(num_sessions)]
    outs: dict[int, list[list[int]]] = {i: [] for i in range(num_sessions)}
    for k in range(3):
        rids = {eng.add_request(all_turns[i][k], GREEDY, session_id=sid): i for i, sid in enumerate(sids)}
        while rids:
            for out in eng.step():
                if out.finished and out.request_id in rids:
                    outs[rids.pop(out.request_id)].append(out.token_ids)
            eng.kv.check_integrity()
            assert eng.kv.num_free_blocks >= 0
        for sid in sids:
            eng.park(sid, tools=("tool",), expected_wait_s=0.01)
        time.sleep(0.02)
    for sid in sids:
        eng.close_session(sid)
    return outs


@pytest.mark.parametrize("policy", ["discard", "keep", "ttl", "least-waste", "predictive"])
def test_every_policy_under_memory_pressure_is_exact_and_clean(tiny_llama: Path, tmp_path: Path, policy: str) -> None:
    roomy = make_engine(tiny_llama, tmp_path / "roomy", num_blocks=256, host_kv_bytes=0, disk_kv_bytes=0)
    want = run_many(roomy, 6, 40)
    # 6 sessions of up to ~140 tokens (9 blocks each) in 20 blocks: most must leave the device.
    tight = make_engine(tiny_llama, tmp_path / "tight", num_blocks=20, residency_policy=policy,
                        host_kv_bytes=8 << 20, max_num_seqs=4)
    assert run_many(tight, 6, 40) == want
    for _ in range(400):
        tight.sessions.tick(time.monotonic(), 0)
        if not tight.sessions.num_moves_pending:
            break
        time.sleep(0.005)
    assert_clean(tight)
    host = tight.mover.host
    assert host.used_bytes <= host.budget_bytes
    tight.close()


def test_forks_equal_independent_sessions_and_share_blocks(tiny_llama: Path, tmp_path: Path) -> None:
    """Two sub-agents forked from one parent: each continues exactly as a fresh session given the same
    history would (greedy), while the history's full blocks are held once."""
    history, branch_a, branch_b = turns(21), turns(22, 1)[0], turns(23, 1)[0]
    eng = make_engine(tiny_llama, tmp_path, residency_policy="keep", host_kv_bytes=0, disk_kv_bytes=0)
    parent = eng.open_session()
    for new in history:
        run_to_end(eng, eng.add_request(new, GREEDY, session_id=parent))
    full = eng.get_session(parent).token_ids
    child_a, child_b = eng.fork_session(parent), eng.fork_session(parent)
    rid_a = eng.add_request(branch_a, GREEDY, session_id=child_a)
    rid_b = eng.add_request(branch_b, GREEDY, session_id=child_b)
    eng.step()  # both prefills in one step: the shared history comes from the prefix cache
    shared = set(eng.kv.block_tables[rid_a]) & set(eng.kv.block_tables[rid_b]) \
        & set(eng.kv.block_tables[eng.get_session(parent).kv_key])
    assert len(shared) == len(full) // 16 > 0
    # The residency policies see that moving the parked parent would free none of those blocks.
    (seen,) = [p for p in eng.sessions.view(0.0, 0).parked if p.session_id == parent]
    assert seen.num_shared_blocks == len(shared) and seen.num_freed_blocks == seen.num_blocks - len(shared)
    # A session's program starts at its first turn and keeps that place in line; forks are part of it.
    start = eng.get_session(parent).program.start_s
    assert start is not None and start < eng.core.requests[rid_a].arrival_s
    assert eng.get_session(child_a).program.start_s == eng.get_session(child_b).program.start_s == start
    done: dict[str, list[int]] = {}
    while len(done) < 2:
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    out_a, out_b = done[rid_a], done[rid_b]
    assert eng.get_session(parent).token_ids == full  # the parent is untouched

    ref = make_engine(tiny_llama, tmp_path / "ref", host_kv_bytes=0, disk_kv_bytes=0, enable_prefix_caching=False)
    for branch, got in ((branch_a, out_a), (branch_b, out_b)):
        sid = ref.open_session()
        assert run_to_end(ref, ref.add_request(full + branch, GREEDY, session_id=sid)) == got
    for sid in (parent, child_a, child_b):
        assert eng.close_session(sid)
    assert_clean(eng)


def test_the_policy_first_sees_a_parked_session_with_its_wait(tiny_llama: Path, tmp_path: Path) -> None:
    """What a turn will wait on goes with the turn: the residency policy's first view of the parked session
    already has the client's expected wait and the tools the reply called."""
    from sessionserve.types.sequence import ParkHint

    eng = make_engine(tiny_llama, tmp_path, residency_policy="predictive")
    seen: list = []
    policy = eng.sessions.policy

    class Recorder:
        name = "recorder"

        def decide(self, view):  # noqa: ANN001, ANN202
            seen.extend(view.parked)
            return policy.decide(view)

        def __getattr__(self, attr: str):  # noqa: ANN204 - the rest of the policy's interface
            return getattr(policy, attr)

    eng.sessions.policy = Recorder()
    sid = eng.open_session()
    hint = ParkHint(expected_wait_s=7.5, tool_names=lambda ids: ("run_tests",) if ids else ())
    run_to_end(eng, eng.add_request(turns(3)[0], GREEDY, session_id=sid, park_hint=hint))
    first = next(p for p in seen if p.session_id == sid)
    assert first.predicted.p50_s == 7.5
    assert eng.get_session(sid).waiting_tools == ("run_tests",)
    eng.close_session(sid)


def test_streamed_outputs_share_one_copy_of_the_prompt_ids(tiny_llama: Path, tmp_path: Path) -> None:
    """Each step's output carries the prompt's ids: one list for the whole request (a copy per token was
    O(context) per running sequence per step), equal to the session's context plus the turn."""
    eng = make_engine(tiny_llama, tmp_path)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    sid = eng.open_session()
    run_to_end(eng, eng.add_request([5, 6, 7, 8] * 10, params, session_id=sid, stream=True))
    rid = eng.add_request([9, 10, 11], params, session_id=sid, stream=True)
    seen = []
    for _ in range(100):
        seen += [o for o in eng.step() if o.request_id == rid]
        if seen and seen[-1].finished:
            break
    assert len(seen) >= 6 and all(o.prompt_token_ids is seen[0].prompt_token_ids for o in seen)
    assert seen[0].prompt_token_ids[:40] == [5, 6, 7, 8] * 10 and seen[0].prompt_token_ids[-3:] == [9, 10, 11]


def test_restore_and_recompute_counters_add_up(tiny_llama: Path, tmp_path: Path) -> None:
    """Each way a turn finds its session's KV is counted once, and the counters agree with each other: every
    byte moved off the device comes back, the recomputed tokens are those the drop threw away, and the
    prompt tokens computed are the new ones plus the recompute."""
    eng = make_engine(tiny_llama, tmp_path, enable_prefix_caching=False)
    sid = eng.open_session()
    ts = turns(14, n=5)
    after = ["host", "host-prefetch", "disk", "drop", "keep"]  # what happens to the KV after each turn
    dropped = 0
    for new, mode in zip(ts, after):
        run_to_end(eng, eng.add_request(new, GREEDY, session_id=sid))
        eng.park(sid, tools=("search",), expected_wait_s=1.0)
        if mode == "drop":
            dropped = eng.get_session(sid).num_computed_tokens
        move(eng, sid, mode)
    stats = eng.get_session(sid).stats
    assert stats.num_turns == 5
    assert stats.num_restore_misses == 2  # resumed from host, then from disk, with no prefetch started
    assert stats.num_prefetch_hits == 1 and stats.num_prefetch_late == 0
    assert stats.num_offloaded_bytes > 0 and stats.num_restored_bytes == stats.num_offloaded_bytes
    assert dropped > 0 and stats.num_recompute_tokens == dropped
    # New tokens, the previous turn's last sampled token (its KV is computed with the next turn), the recompute.
    assert stats.num_computed_prompt_tokens == sum(len(t) for t in ts) + (len(ts) - 1) + dropped
    total = eng.sessions.total_stats()
    assert eng.close_session(sid)
    assert eng.sessions.total_stats() == total  # a closed session's counters stay in the totals
    assert_clean(eng)
    eng.close()
