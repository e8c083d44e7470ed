"""Noisy neighbour: one tenant's adversarial traffic must not hurt another tenant's streams.

Alice (`key-alice`) runs steady greedy chat streams: a fixed set of prompts,
temperature 0, 30-60 tokens each, a few at a time. First alone (the quiet
run), then while Bob (`key-bob`) sends the adversarial corpus
(tests/reliability/adversarial.py: huge seeds and bodies, token ids past the
vocabulary, pathological schemas, floods, hang-ups, ...) and then fuzzed
requests, then alone again. Alice and Bob each run in a process of their own,
as other clients would (their HTTP clients do not take the server's
interpreter), and Bob's runs only on CPU the others leave (SCHED_IDLE): on a
shared 2-core machine his process would otherwise take a core from the server,
which measures the machine, not the server's isolation of his requests.

What must hold: every stream of Alice's completes with the text of the quiet
run; her p99 inter-token gap stays within 2x the quiet run's just before; no
answer to Bob is a 5xx or breaks the corpus contract; afterwards the server is
idle with every KV block free and /health is fast.

    .venv/bin/python bench/noisy_neighbour.py                       # the corpus + 10,000 fuzzed requests
    .venv/bin/python bench/noisy_neighbour.py --fuzz 1000 --out bench/out/noisy_neighbour.json
    .venv/bin/python bench/noisy_neighbour.py --fuzz 0 --case "seed 2**70 /v1/chat/completions"

The server runs in this process (engine thread + uvicorn on a free 127.0.0.1
port); Alice is tests/reliability/bystander.py. tests/reliability/test_noisy_neighbour.py runs the same driver with a
few hundred fuzzed requests.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the corpus lives with the tests
    sys.path.insert(0, str(ROOT))

from tests.reliability import adversarial, fuzz_bodies  # noqa: E402
from tests.reliability.bystander import Bystander, StreamResult  # noqa: E402

GAP_RATIO_TARGET = 2.0  # the bound on noisy p99 / quiet p99


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class GapStats:
    num_streams: int = 0
    num_gaps: int = 0
    p50_s: float | None = None
    p99_s: float | None = None
    max_s: float | None = None
    ttft_p99_s: float | None = None

    @classmethod
    def of(cls, results: list[StreamResult], start: float = 0.0, end: float = float("inf")) -> GapStats:
        gaps = [g for r in results for g in r.gaps(start, end)]
        ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
        r4 = lambda x: None if x is None else round(x, 4)  # noqa: E731
        return cls(len(results), len(gaps), r4(percentile(gaps, 0.5)), r4(percentile(gaps, 0.99)),
                   r4(max(gaps, default=None)), r4(percentile(ttfts, 0.99)))


@dataclass
class NoisyReport:
    quiet_before: GapStats = field(default_factory=GapStats)
    corpus: GapStats = field(default_factory=GapStats)  # while Bob sends the corpus
    fuzz: GapStats = field(default_factory=GapStats)  # while Bob sends fuzzed requests
    quiet_after: GapStats = field(default_factory=GapStats)
    p99_ratio: float | None = None  # corpus p99 / quiet-before p99
    quiet_is_repeatable: bool = True  # each prompt streamed the same text every time it ran alone
    alice_failures: list[str] = field(default_factory=list)  # failed streams, and texts unlike the quiet run's
    cases: list[dict[str, Any]] = field(default_factory=list)
    num_cases_failed: int = 0
    fuzz_sent: int = 0
    fuzz_statuses: dict[str, int] = field(default_factory=dict)
    fuzz_5xx: int = 0
    fuzz_failures: list[str] = field(default_factory=list)
    corpus_s: float = 0.0
    fuzz_s: float = 0.0
    # Alice's corpus-phase gaps over the target (2x the quiet p99), counted per case that ran during the gap
    # (a gap during several cases counts for each; "(none)": no case ran, e.g. between cases)
    slow_gaps_by_case: dict[str, int] = field(default_factory=dict)
    num_slow_gaps: int = 0

    def summary(self) -> str:
        lines = [f"{'phase':<14}{'streams':>8}{'gaps':>7}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'ttft p99 ms':>13}"]
        for name in ("quiet_before", "corpus", "fuzz", "quiet_after"):
            g: GapStats = getattr(self, name)
            ms = lambda x: "-" if x is None else f"{1000 * x:.1f}"  # noqa: E731
            lines.append(f"{name:<14}{g.num_streams:>8}{g.num_gaps:>7}{ms(g.p50_s):>9}{ms(g.p99_s):>9}"
                         f"{ms(g.max_s):>9}{ms(g.ttft_p99_s):>13}")
        lines.append(f"p99 ratio (corpus / quiet before): {self.p99_ratio} (target <= {GAP_RATIO_TARGET})")
        lines.append(f"alice: {len(self.alice_failures)} failed or changed streams; quiet run repeatable: "
                     f"{self.quiet_is_repeatable}")
        lines.append(f"corpus: {len(self.cases) - self.num_cases_failed}/{len(self.cases)} cases hold "
                     f"({self.corpus_s:.1f} s)")
        for c in self.cases:
            if c["problems"]:
                lines.append(f"  FAIL {c['name']}: {c['problems'][0][:240]}"
                             + (f" (+{len(c['problems']) - 1} more)" if len(c["problems"]) > 1 else "")
                             + (f" notes={c['notes']}" if c["notes"] else ""))
        worst = sorted(self.cases, key=lambda c: -(c["alice_max_s"] or 0))[:5]
        lines.append("alice's largest gaps while a case ran: " + "; ".join(
            f"{c['name']}: max {1000 * (c['alice_max_s'] or 0):.0f} ms, p99 {1000 * (c['alice_p99_s'] or 0):.0f} ms"
            for c in worst))
        if self.num_slow_gaps:
            by_case = sorted(self.slow_gaps_by_case.items(), key=lambda kv: -kv[1])[:8]
            lines.append(f"alice's {self.num_slow_gaps} gaps over {GAP_RATIO_TARGET}x the quiet p99, by case running: "
                         + "; ".join(f"{name}: {n}" for name, n in by_case))
        lines.append(f"fuzz: {self.fuzz_sent} requests in {self.fuzz_s:.1f} s, {self.fuzz_5xx} answered 5xx; "
                     f"statuses {dict(sorted(self.fuzz_statuses.items()))}")
        lines += [f"  {f[:300]}" for f in self.fuzz_failures[:10]]
        lines += [f"  alice: {f[:300]}" for f in self.alice_failures[:10]]
        return "\n".join(lines)


def _reference(results: list[StreamResult]) -> tuple[dict[int, str], bool]:
    """Each prompt's quiet text, and whether every quiet run of it gave the same text."""
    texts: dict[int, set[str]] = {}
    for r in results:
        if r.error is None:
            texts.setdefault(r.prompt_index, set()).add(r.text)
    return {i: sorted(t)[0] for i, t in texts.items()}, all(len(t) == 1 for t in texts.values())


def _judge(results: list[StreamResult], reference: dict[int, str]) -> list[str]:
    out = []
    for r in results:
        if r.error is not None:
            out.append(f"[{r.phase}] prompt {r.prompt_index}: status {r.status}, {r.error}")
        elif r.prompt_index in reference and r.text != reference[r.prompt_index]:
            out.append(f"[{r.phase}] prompt {r.prompt_index}: text differs from the quiet run: {r.text[:80]!r} vs "
                       f"{reference[r.prompt_index][:80]!r}")
    return out


def _slow_gaps_by_case(results: list[StreamResult], outcomes: list, start: float, end: float,
                       bound_s: float) -> tuple[int, dict[str, int]]:
    """How many of Alice's gaps in [start, end) exceed `bound_s`, and how many overlap each case's run."""
    count, by_case = 0, {}
    for r in results:
        t = r.token_times
        for a, b in zip(t, t[1:]):
            if not (start <= b < end) or b - a <= bound_s:
                continue
            count += 1
            names = [o.name for o in outcomes if o.started_at < b and a < o.started_at + o.elapsed_s] or ["(none)"]
            for name in names:
                by_case[name] = by_case.get(name, 0) + 1
    return count, by_case


def run_noisy_neighbour(url: str, target: adversarial.Target, *, case_names: list[str] | None = None,
                        num_fuzz: int = 0, seed: int = 0, num_streams: int = 2, quiet_rounds: int = 2,
                        num_bob_workers: int = 3) -> NoisyReport:
    """Quiet run, then Bob's corpus and fuzzing while Alice streams, then a quiet run again.

    `target.victim_request_ids` is filled in with Alice's ids. Returns the report; raises nothing on a
    failed check (the caller decides)."""
    alice = Bystander(url, num_streams)
    target = adversarial.Target(**{**asdict(target), "victim_request_ids": alice.request_ids})
    report = NoisyReport()
    ctx = multiprocessing.get_context("spawn")  # not fork: this process runs the engine's threads
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx, initializer=adversarial.below_the_server) as bob:
        bob.submit(adversarial.case_names).result()  # Bob's process is up and has the corpus loaded
        alice.run_rounds("warm-up", 1)
        before = alice.run_rounds("quiet-before", quiet_rounds)
        reference, report.quiet_is_repeatable = _reference(before)
        alice.start("corpus")
        corpus_start = time.time()
        outcomes = bob.submit(adversarial.run_cases, target, case_names, num_bob_workers).result()
        alice.phase, fuzz_start = "fuzz", time.time()
        fuzz = bob.submit(fuzz_bodies.run_fuzz, target, num_fuzz, seed, num_bob_workers).result() if num_fuzz \
            else fuzz_bodies.FuzzReport()
        fuzz_end = time.time()
        noisy = alice.stop()
    after = alice.run_rounds("quiet-after", quiet_rounds)

    report.quiet_before, report.quiet_after = GapStats.of(before), GapStats.of(after)
    report.corpus_s, report.fuzz_s = round(fuzz_start - corpus_start, 1), round(fuzz_end - fuzz_start, 1)
    report.corpus = GapStats.of(noisy, corpus_start, fuzz_start)
    report.fuzz = GapStats.of(noisy, fuzz_start, fuzz_end)
    report.corpus.num_streams = sum(r.phase == "corpus" for r in noisy)
    report.fuzz.num_streams = sum(r.phase == "fuzz" for r in noisy)
    if report.corpus.p99_s and report.quiet_before.p99_s:
        report.p99_ratio = round(report.corpus.p99_s / report.quiet_before.p99_s, 2)
    report.alice_failures = _judge(before + noisy + after, reference)
    for o in outcomes:  # Alice's gaps while each case ran (others may have run alongside)
        during = GapStats.of(noisy, o.started_at, o.started_at + o.elapsed_s)
        report.cases.append({**o._asdict(), "alice_p99_s": during.p99_s, "alice_max_s": during.max_s})
    report.num_cases_failed = sum(not o.is_ok for o in outcomes)
    if report.quiet_before.p99_s:
        report.num_slow_gaps, report.slow_gaps_by_case = _slow_gaps_by_case(
            noisy, outcomes, corpus_start, fuzz_start, GAP_RATIO_TARGET * report.quiet_before.p99_s)
    report.fuzz_sent, report.fuzz_statuses = fuzz.num_sent, dict(fuzz.statuses)
    report.fuzz_5xx, report.fuzz_failures = fuzz.num_5xx, fuzz.failures
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fuzz", type=int, default=10_000, help="fuzzed requests Bob sends after the corpus")
    parser.add_argument("--case", action="append", default=None, help="run only this corpus case (repeatable)")
    parser.add_argument("--skip", action="append", default=[], help="skip the cases whose name has this (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--streams", type=int, default=2, help="Alice's concurrent streams")
    parser.add_argument("--quiet-rounds", type=int, default=3)
    parser.add_argument("--bob-workers", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--size", choices=("tiny", "small"), default="tiny",
                        help="the embedded model's size: tiny (the CI test's) or small (`sessionserve serve`'s default)")
    parser.add_argument("--engine", action="append", default=[], metavar="NAME=VALUE",
                        help="an engine option for the server (repeatable), e.g. max_num_batched_tokens=512")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()

    import tempfile

    from sessionserve.config import ServerConfig
    from sessionserve.modelgen import make_model as mm
    from tests.reliability.conftest import close_all_sessions, kv_state, live_server, wait_idle

    model = mm.ensure_model("llama", args.size, ROOT / "bench" / "out" / "models")
    spool = Path(tempfile.mkdtemp(prefix="noisy-spool-"))
    options = {name: json.loads(value) for name, value in (o.split("=", 1) for o in args.engine)}
    with live_server(model, spool, **{"num_blocks": args.num_blocks, "host_kv_bytes": 0, "disk_kv_bytes": 0,
                                      **options}) as server:
        target = adversarial.Target(server.url, vocab_size=server.engine.runner.arch.vocab_size,
                                    max_model_len=server.engine.max_model_len,
                                    max_request_bytes=ServerConfig().max_request_bytes)
        names = [n for n in args.case or adversarial.case_names() if not any(s in n for s in args.skip)]
        report = run_noisy_neighbour(server.url, target, case_names=names, num_fuzz=args.fuzz, seed=args.seed,
                                     num_streams=args.streams, quiet_rounds=args.quiet_rounds,
                                     num_bob_workers=args.bob_workers)
        try:
            wait_idle(server, timeout_s=30)
            is_idle = True
        except AssertionError:
            is_idle = False
        close_all_sessions(server)
        kv = server.call(kv_state)
        t0 = time.perf_counter()
        health = httpx.get(server.url + "/health", timeout=30).status_code
        health_s = time.perf_counter() - t0
    print(report.summary())
    leaked = kv["device_total"] - kv["device_free"]
    print(f"after: idle={is_idle} kv blocks in use={leaked}/{kv['device_total']} tables={kv['block_tables']} "
          f"/health={health} in {1000 * health_s:.1f} ms")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**asdict(report), "after": {
            "idle": is_idle, "kv": kv, "health_s": health_s}}, indent=2, default=str) + "\n")
    ok = (not report.alice_failures and not report.num_cases_failed and not report.fuzz_5xx and is_idle
          and not leaked and health == 200 and (report.p99_ratio or 0) <= GAP_RATIO_TARGET)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
