"""Agent sessions under memory pressure: the five residency policies side by side, in one run.

Replays real Claude Code sessions (../shared/traces/weka_claude_code: per-step
prompt growth, output length and the real wait after each step) through the
in-process engine on the embedded `small` model, with a device KV budget too
small to keep every waiting session resident. This is `sessionserve bench`
with the settings recorded in bench/RESULTS.md; every flag of that command
works here too (tokens / 128 and waits / 10 by default, stated in the report).

    .venv/bin/python bench/sessions.py                     # all five policies, 8 and 16 agents
    .venv/bin/python bench/sessions.py --policies discard,predictive --loads 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sessionserve.cli_bench import add_bench_arguments, run_bench  # noqa: E402

DEFAULTS = {
    "trace": "weka_claude_code",
    "num_sessions": 24,
    "max_steps": 6,
    "loads": "8,16",
    "device_kv_bytes": 96 << 20,  # ~250 blocks of 16 tokens: about 4 sessions' context
    "host_kv_bytes": 2 << 30,
    "out": str(ROOT / "bench" / "out" / "sessions"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    parser.set_defaults(**DEFAULTS)
    run_bench(parser.parse_args())


if __name__ == "__main__":
    main()
