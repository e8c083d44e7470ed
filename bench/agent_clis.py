"""The real Codex CLI and Claude Code against `sessionserve serve`, end to end, offline on loopback.

    .venv/bin/python bench/agent_clis.py                    # both CLIs; table on stdout
    .venv/bin/python bench/agent_clis.py --clients claude   # one of them

What runs: a long-context embedded model (Claude Code opens with ~23k tokens
of system prompt and tools, more than the default model's 8192) is built once
into bench/out/agent_clis/models/, `sessionserve serve` starts on a free
loopback port with it, and each installed CLI runs twice in one session with
throwaway config folders:

    codex exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox "say hi"
    codex exec ... resume --last "say bye"          (same CODEX_HOME and cwd)
    claude -p "say hi"
    claude -p --continue "say bye"                  (same CLAUDE_CONFIG_DIR and cwd)

A plain text answer is one model request per invocation, so the second
invocation (which resends the whole conversation) is each client's second
model request. The server logs one line per finished request; the table
shows each request's prompt and cached tokens and TTFT. The script exits 1
if a CLI exits non-zero, the server answers a request with a 4xx/5xx, or a
client's second request has less than 90% of its prompt cached.

Why the model's end-of-turn row is scaled: the embedded model has random
weights, so it samples `<|im_end|>` about once per vocabulary size (16k)
tokens, and Codex sends no `max_output_tokens` (no config setting makes it):
"say hi" took 17,390 tokens and 6.5 minutes on this machine. Scaling the
`<|im_end|>` row of `lm_head` by `--eos-scale` (default 3) makes answers end
after a few to ~1,200 tokens, more like an assistant's, with the model's own
end-of-turn token (so the history the client resends re-renders exactly as
generated). `--eos-scale 1` serves the model as `make-model` writes it.
A CLI that is not on PATH is skipped with a message.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sessionserve.workload.server_process import server_process  # noqa: E402

OUT_DIR = ROOT / "bench" / "out" / "agent_clis"
CONTEXT_LEN = 65536  # tokens: Claude Code's first request is ~23k, and the conversation grows from there
SERVED_MODEL_NAME = "sessionserve-tiny"
MIN_CACHED_FRACTION = 0.9  # of the second request's prompt (the bar)
CLIENTS = ("codex", "claude")
FIRST_PROMPT, SECOND_PROMPT = "say hi", "say bye"
# Anything the caller's shell says about real accounts stays out of the CLIs' environment.
_SCRUBBED_PREFIXES = ("OPENAI_", "ANTHROPIC_", "CLAUDE_", "CODEX_")


# --------------------------------------------------------------------------- model and server

def ensure_model(cache_dir: Path = OUT_DIR / "models", eos_scale: float = 3.0) -> Path:
    """The tiny Llama embedded model with a 64k context, its `<|im_end|>` logit row scaled; built if missing."""
    from sessionserve.modelgen import make_model as mm

    out = cache_dir / f"tiny-ctx{CONTEXT_LEN}-eos{eos_scale:g}"
    if (out / "config.json").is_file():
        return out
    tok_path = mm.ensure_tokenizer()
    eos, pad = mm.special_token_ids(tok_path)
    cfg = mm.model_config("llama", "tiny", eos_token_id=eos, pad_token_id=pad)
    cfg["max_position_embeddings"] = CONTEXT_LEN

    def weights() -> dict:
        tensors = mm.init_weights("llama", cfg, seed=0)
        tensors["lm_head.weight"][eos] *= eos_scale  # NOTE: see the module docstring for why
        return tensors

    return mm.write_model_folder(out, cfg, weights, tok_path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model_dir: Path, log_path: Path) -> Iterator[str]:
    """`sessionserve serve` on a free loopback port until the block ends; yields its base URL (no /v1)."""
    port = free_port()
    cmd = [sys.executable, "-m", "sessionserve.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", SERVED_MODEL_NAME]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with server_process(cmd, port, log_path, start_timeout_s=300, name="sessionserve"):
        yield f"http://127.0.0.1:{port}"


# --------------------------------------------------------------------------- the server's log

_COMPLETION = re.compile(
    r"sessionserve\.requests \[[^\]]*\] (?P<protocol>\w+)\.completion .*?prompt_tokens=(?P<prompt>\d+) "
    r"cached_tokens=(?P<cached>\d+) output_tokens=(?P<output>\d+) finish=(?P<finish>\S+) ttft_s=(?P<ttft>\S+)")
_ACCESS = re.compile(r'uvicorn\.access \[[^\]]*\] \S+ - "(?P<method>\S+) (?P<path>\S+) [^"]*" (?P<status>\d{3})')
_MODEL_PATHS = ("/v1/responses", "/v1/messages", "/v1/chat/completions")


@dataclass(frozen=True)
class ModelRequest:
    """One finished model request, as the server logged it."""

    protocol: str  # responses / messages / chat
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    finish_reason: str
    ttft_s: float | None

    @property
    def cached_fraction(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


@dataclass(frozen=True)
class LogChunk:
    """What the server logged while one CLI invocation ran."""

    requests: tuple[ModelRequest, ...]
    num_model_posts: int  # POSTs to a model endpoint (each should end in one `requests` line)
    errors: tuple[str, ...]  # access lines with a 4xx/5xx status, and traceback lines


def parse_log(text: str) -> LogChunk:
    requests, errors, num_posts = [], [], 0
    for line in text.splitlines():
        if m := _COMPLETION.search(line):
            ttft = None if m["ttft"] == "None" else float(m["ttft"])
            requests.append(ModelRequest(m["protocol"], int(m["prompt"]), int(m["cached"]), int(m["output"]),
                                         m["finish"], ttft))
        elif m := _ACCESS.search(line):
            if m["method"] == "POST" and m["path"].split("?")[0] in _MODEL_PATHS:
                num_posts += 1
            if int(m["status"]) >= 400:
                errors.append(line.strip())
        elif "Traceback" in line:
            errors.append(line.strip())
    return LogChunk(tuple(requests), num_posts, tuple(errors))


def read_new_log(log_path: Path, offset: int, wait_s: float = 15.0) -> LogChunk:
    """The log from `offset` on, once every model POST in it has its finished-request line (or after wait_s)."""
    deadline = time.monotonic() + wait_s
    while True:
        with log_path.open("rb") as f:
            f.seek(offset)
            chunk = parse_log(f.read().decode(errors="replace"))
        if len(chunk.requests) >= chunk.num_model_posts or time.monotonic() > deadline:
            return chunk
        time.sleep(0.2)


# --------------------------------------------------------------------------- running the CLIs

@dataclass(frozen=True)
class Invocation:
    """One run of a CLI: what was run, how it ended, and the model requests it made."""

    label: str  # e.g. `exec resume --last`
    exit_code: int
    wall_s: float
    log: LogChunk


@dataclass(frozen=True)
class ClientRun:
    client: str
    version: str
    invocations: tuple[Invocation, ...]

    @property
    def requests(self) -> list[ModelRequest]:
        return [r for inv in self.invocations for r in inv.log.requests]

    def problems(self) -> list[str]:
        """Why this client's run fails the bar; empty when it passes."""
        out = [f"{self.client} {inv.label}: exit code {inv.exit_code}" for inv in self.invocations if inv.exit_code]
        out += [f"{self.client} {inv.label}: server logged {err}" for inv in self.invocations for err in inv.log.errors]
        requests = self.requests
        if len(requests) < 2:
            out.append(f"{self.client}: {len(requests)} model request(s), expected at least 2")
        elif requests[1].cached_fraction < MIN_CACHED_FRACTION:
            r = requests[1]
            out.append(f"{self.client}: second request has {r.num_cached_tokens}/{r.num_prompt_tokens} prompt "
                       f"tokens cached ({r.cached_fraction:.1%} < {MIN_CACHED_FRACTION:.0%})")
        return out


def cli_version(binary: str) -> str | None:
    """`binary --version`'s first line, or None if it is not on PATH."""
    if shutil.which(binary) is None:
        return None
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else f"unknown ({done.returncode})"


def _clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUBBED_PREFIXES)}
    # Anything a CLI writes under ~ lands in the throwaway folder. NOTE: that folder is under out_dir, not
    # /tmp: Codex refuses to put its helper commands (apply_patch) on PATH from a temporary directory.
    env["HOME"] = str(home)
    return env


def _invoke(label: str, cmd: list[str], env: dict[str, str], cwd: Path, log_path: Path, out_dir: Path,
            timeout_s: float) -> Invocation:
    """Run one CLI command to the end (stdin closed) and collect what the server logged meanwhile."""
    offset = log_path.stat().st_size
    stem = out_dir / re.sub(r"\W+", "-", f"{Path(cmd[0]).name} {label}").strip("-")
    print(f"[{Path(cmd[0]).name}] {label}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with open(f"{stem}.out", "w") as stdout, open(f"{stem}.err", "w") as stderr:
        try:
            exit_code = subprocess.run(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout,
                                       stderr=stderr, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            exit_code = 124
    return Invocation(label, exit_code, time.monotonic() - t0, read_new_log(log_path, offset))


def run_codex(base_url: str, log_path: Path, out_dir: Path, timeout_s: float = 600.0) -> ClientRun | None:
    """`codex exec "say hi"`, then `codex exec resume --last "say bye"`; None if codex is not installed."""
    version = cli_version("codex")
    if version is None:
        return None
    with tempfile.TemporaryDirectory(prefix="codex-", dir=out_dir) as tmp:
        home, work = Path(tmp) / "home", Path(tmp) / "work"
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True)
        work.mkdir()
        # Retries off: a failed stream must show as a failure, not as a second request.
        codex_home.joinpath("config.toml").write_text(
            f'model = "{SERVED_MODEL_NAME}"\nmodel_provider = "sessionserve"\n\n'
            f'[model_providers.sessionserve]\nname = "sessionserve"\nbase_url = "{base_url}/v1"\n'
            f'wire_api = "responses"\nenv_key = "SESSIONSERVE_CLIENT_KEY"\n'
            f'request_max_retries = 0\nstream_max_retries = 0\n')
        env = _clean_env(home) | {"CODEX_HOME": str(codex_home), "SESSIONSERVE_CLIENT_KEY": "x"}
        exec_cmd = ["codex", "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
        invocations = (
            _invoke("exec", [*exec_cmd, FIRST_PROMPT], env, work, log_path, out_dir, timeout_s),
            _invoke("exec resume --last", [*exec_cmd, "resume", "--last", SECOND_PROMPT], env, work, log_path,
                    out_dir, timeout_s),
        )
    return ClientRun("codex", version, invocations)


def run_claude(base_url: str, log_path: Path, out_dir: Path, timeout_s: float = 600.0) -> ClientRun | None:
    """`claude -p "say hi"`, then `claude -p --continue "say bye"`; None if claude is not installed."""
    version = cli_version("claude")
    if version is None:
        return None
    with tempfile.TemporaryDirectory(prefix="claude-", dir=out_dir) as tmp:
        home, work = Path(tmp) / "home", Path(tmp) / "work"
        home.mkdir()
        work.mkdir()
        env = _clean_env(home) | {
            "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": "x", "ANTHROPIC_MODEL": SERVED_MODEL_NAME,
            "CLAUDE_CONFIG_DIR": str(home / ".claude"), "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
        invocations = (
            _invoke("-p", ["claude", "-p", FIRST_PROMPT], env, work, log_path, out_dir, timeout_s),
            _invoke("-p --continue", ["claude", "-p", "--continue", SECOND_PROMPT], env, work, log_path, out_dir,
                    timeout_s),
        )
    return ClientRun("claude", version, invocations)


RUNNERS = {"codex": run_codex, "claude": run_claude}


# --------------------------------------------------------------------------- report

def format_table(runs: list[ClientRun]) -> str:
    """A Markdown table: one row per model request, in order, per client."""
    rows = ["| client | version | invocation | request # | prompt tokens | cached tokens | cached | TTFT s "
            "| output tokens | finish | exit code |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        num = 0
        for inv in run.invocations:
            if not inv.log.requests:
                rows.append(f"| {run.client} | {run.version} | {inv.label} | - | - | - | - | - | - | - "
                            f"| {inv.exit_code} |")
            for r in inv.log.requests:
                num += 1
                ttft = f"{r.ttft_s:.3f}" if r.ttft_s is not None else "-"
                rows.append(f"| {run.client} | {run.version} | {inv.label} | {num} | {r.num_prompt_tokens:,} "
                            f"| {r.num_cached_tokens:,} | {r.cached_fraction:.1%} | {ttft} | {r.num_output_tokens:,} "
                            f"| {r.finish_reason} | {inv.exit_code} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default=",".join(CLIENTS), help="comma-separated: codex, claude")
    parser.add_argument("--eos-scale", type=float, default=3.0,
                        help="factor on the <|im_end|> row of lm_head (1: the model as make-model writes it)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per CLI invocation")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="server log and CLI outputs")
    args = parser.parse_args()
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    if unknown := sorted(set(clients) - set(CLIENTS)):
        parser.error(f"unknown client(s) {unknown}; expected some of {CLIENTS}")
    installed = [c for c in clients if shutil.which(c)]
    for c in sorted(set(clients) - set(installed)):
        print(f"skipping {c}: `{c}` is not on PATH (npm install -g "
              f"{'@openai/codex' if c == 'codex' else '@anthropic-ai/claude-code'})", file=sys.stderr)
    if not installed:
        raise SystemExit("no agent CLI to run")

    model_dir = ensure_model(args.out / "models", args.eos_scale)
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "server.log"
    started = datetime.datetime.now(datetime.timezone.utc)
    with serve(model_dir, log_path) as base_url:
        runs = [run for c in installed if (run := RUNNERS[c](base_url, log_path, args.out, args.timeout_s))]

    print(f"# {started:%Y-%m-%d %H:%M} UTC, model {model_dir.name} (served as {SERVED_MODEL_NAME!r}), "
          f"server log {log_path}")
    print(format_table(runs))
    problems = [p for run in runs for p in run.problems()]
    for p in problems:
        print(f"FAIL {p}")
    if problems:
        raise SystemExit(1)
    print(f"OK: every CLI exited 0 and each client's second request had >= {MIN_CACHED_FRACTION:.0%} cached")


if __name__ == "__main__":
    main()
