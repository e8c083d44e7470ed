"""A small coding agent on the sessionserve agent runtime, with three real local tools.

Tools: `search_files` (a grep over a folder), `calculator` (arithmetic parsed
with `ast`, never `eval`) and `http_get` (GET on 127.0.0.1 only; `--serve-dir`
starts a local file server to call). Independent calls of one step run
concurrently; on sessionserve the run holds a session that parks while the
tools run and resumes from its KV.

    sessionserve serve --api-key sk-local &
    .venv/bin/python examples/coding_agent.py --base-url http://127.0.0.1:8000/v1 --api-key sk-local \\
        --task "Where is the retry budget defined, and what is 17 * 23?" --tool-choice required,auto

The embedded default model has random weights: it calls tools only when
forced (`--tool-choice required` for the first steps) and answers gibberish.
A real model needs no forcing. Any OpenAI-compatible server works too.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import functools
import http.server
import operator
import re
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated
from urllib.parse import urlparse

import httpx
from pydantic import Field

from sessionserve.agent import Agent, AgentConfig, AgentResult, ChatClient, ToolError, ToolRegistry

MAX_FILE_BYTES = 1 << 20  # skip files larger than this: a grep over a tree should not read binaries
SKIP_DIRS = {".git", ".venv", "__pycache__", "node_modules", ".mypy_cache", ".pytest_cache"}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# NOTE: bounded strings (and no free integers) keep a constrained decoder from writing one argument until
# max_tokens runs out: a model that only calls tools when forced has no other reason to stop.
Short = Annotated[str, Field(max_length=64)]


def grep(root: Path, pattern: str, path: str = ".", max_results: int = 20) -> list[str]:
    """Lines matching `pattern` in the files under root/path, as 'file:line: text' (at most max_results)."""
    base = (root / path).resolve()
    if not base.is_relative_to(root.resolve()):
        raise ToolError(f"path {path!r} is outside the workspace", is_retryable=False)
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ToolError(f"bad pattern: {exc}", is_retryable=False) from None
    hits: list[str] = []
    files = [base] if base.is_file() else sorted(base.rglob("*"))
    for file in files:
        if not file.is_file() or SKIP_DIRS & set(file.parts) or file.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        for num, line in enumerate(lines, 1):
            if regex.search(line):
                hits.append(f"{file.relative_to(root.resolve())}:{num}: {line.strip()[:200]}")
                if len(hits) >= max(1, min(max_results, 200)):
                    return hits
    return hits


def calculator(expression: Short) -> float:
    """Evaluate arithmetic: numbers, + - * / // % ** and parentheses."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ToolError("exponent too large", is_retryable=False)
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        raise ToolError(f"unsupported expression: {ast.dump(node)[:80]}", is_retryable=False)

    try:
        return ev(ast.parse(expression, mode="eval"))
    except (SyntaxError, ZeroDivisionError, OverflowError) as exc:
        raise ToolError(f"cannot evaluate {expression!r}: {exc}", is_retryable=False) from None


async def http_get(url: Short) -> str:
    """GET a URL on this machine (127.0.0.1 or localhost only); returns the status and up to 2000 characters."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or parsed.hostname not in ("127.0.0.1", "localhost"):
        raise ToolError("only http(s)://127.0.0.1 URLs are allowed", is_retryable=False)
    async with httpx.AsyncClient(timeout=5.0) as client:
        resp = await client.get(url)
    if resp.status_code >= 500 or resp.status_code == 429:
        raise ToolError(f"HTTP {resp.status_code}")  # retryable: the runtime's budget decides
    return f"HTTP {resp.status_code}\n{resp.text[:2000]}"


def build_tools(root: Path) -> ToolRegistry:
    tools = ToolRegistry()

    @tools.tool(timeout_s=20.0, max_concurrency=4)
    def search_files(pattern: Short, path: Short = ".") -> list[str]:
        """Search file contents under `path` (relative to the workspace) for a regular expression.

        Returns up to 20 lines as 'file:line: text'.
        """
        return grep(root, pattern, path, 20)

    tools.add(calculator, timeout_s=1.0)
    tools.add(http_get, timeout_s=10.0)
    return tools


@contextmanager
def file_server(directory: Path) -> Iterator[str]:
    """Serve `directory` over HTTP on a free 127.0.0.1 port, for `http_get` to call."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default="default")
    p.add_argument("--task", default="Find where the retry budget is defined, and compute 17 * 23.")
    p.add_argument("--root", default=".", help="workspace that search_files may read")
    p.add_argument("--tool-choice", default="auto",
                   help="comma list, one per step, then auto: e.g. required,auto (needed by random-weight models)")
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--stream", action="store_true", help="print the answer as it streams")
    p.add_argument("--serve-dir", default=None, help="serve this folder on 127.0.0.1 and mention its URL in the task")
    return p.parse_args(argv)


async def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> AgentResult:
    choices = [c.strip() for c in args.tool_choice.split(",") if c.strip()]
    config = AgentConfig(max_steps=args.max_steps, tool_choice=choices if len(choices) > 1 else choices[0],
                         stream=args.stream,
                         model_params={"max_tokens": args.max_tokens, "temperature": args.temperature})
    client = ChatClient(args.base_url, args.api_key, model=args.model)
    agent = Agent(client, build_tools(Path(args.root)), config)
    on_event = None
    if args.stream:
        from sessionserve.agent import TextDelta

        def on_event(event: object) -> None:
            if isinstance(event, TextDelta):
                sys.stdout.write(event.text)
                sys.stdout.flush()
    try:
        messages = [{"role": "system", "content": "You are a coding agent. Use the tools, then answer briefly."},
                    {"role": "user", "content": args.task}]
        result = await agent.run(messages, on_event=on_event)
    finally:
        agent.close()
        await client.aclose()
    mode = f"session {result.session_id}" if result.session_id else "plain chat completions (no sessions)"
    out(f"\nserver: {mode}; stop: {result.stop_reason}; steps: {len(result.steps)}; "
        f"tool calls: {result.num_tool_calls}; re-plans: {result.num_replans}")
    out("step  model_s  tools_s  critical_s  sum_tool_s  cached_tok  calls")
    for s in result.steps:
        calls = ", ".join(f"{c.name}{'' if c.is_ok else '!'}" for c in s.tool_calls)
        out(f"{s.step:4d}  {s.model_s:7.3f}  {s.tools_s:7.3f}  {s.critical_path_s:10.3f}  {s.sum_tool_s:10.3f}  "
            f"{s.num_cached_tokens:10d}  {calls}")
    if result.error:
        out(f"error: {result.error}")
    if not args.stream:  # a streamed answer is already on the screen
        out(f"answer: {result.answer!r}")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_dir:
        with file_server(Path(args.serve_dir)) as url:
            args.task += f" Files are served at {url}."
            result = asyncio.run(run(args))
    else:
        result = asyncio.run(run(args))
    return 0 if result.stop_reason in ("answer", "max_steps") else 1


if __name__ == "__main__":
    raise SystemExit(main())
