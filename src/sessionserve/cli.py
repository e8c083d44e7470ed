"""Command line: `sessionserve serve | bench | demo | make-model | generate`."""

from __future__ import annotations

import argparse
import sys

from sessionserve.config import ADMISSION_MODES


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", action="append", default=None, metavar="[NAME=]PATH",
                        help="Hugging Face model folder (default: the embedded model); serve takes several as "
                             "NAME=PATH (e.g. large=... small=...), each an engine of its own, and adds model 'auto'")
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="device-tier KV budget in bytes")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--speculative-method", choices=("none", "ngram", "draft"), default="none",
                        help="speculative decoding: prompt lookup (ngram) or a draft model")
    parser.add_argument("--draft-model", default=None, help="draft model folder (same tokenizer) for --speculative-method draft")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="most tokens proposed per step")
    parser.add_argument("--draft-dtype", default=None, choices=("auto", "float32", "bfloat16", "float16"),
                        help="the draft model's dtype (default: the target's); bfloat16 makes a small draft's "
                             "steps about twice as fast on CPUs with native bf16, outputs unchanged")


def _spec_kwargs(args: argparse.Namespace) -> dict:
    return dict(speculative_method=args.speculative_method, draft_model=args.draft_model,
                num_speculative_tokens=args.num_speculative_tokens, draft_dtype=args.draft_dtype)


def model_specs(values: list[str] | None) -> list[tuple[str | None, str | None]]:
    """`--model` values as (served name or None, folder or None for the embedded model)."""
    if not values:
        return [(None, None)]
    specs: list[tuple[str | None, str | None]] = []
    for value in values:
        name, sep, path = value.partition("=")
        specs.append((name, path) if sep and name and "/" not in name else (None, value))
    if len(specs) > 1 and any(name is None for name, _ in specs):
        raise SystemExit("several --model values must each be NAME=PATH")
    names = [name for name, _ in specs]
    if len(set(names)) != len(names):
        raise SystemExit("--model names must differ")
    return specs


def _single_model(args: argparse.Namespace) -> str | None:
    specs = model_specs(args.model)
    if len(specs) > 1:
        raise SystemExit("this command takes one --model")
    return specs[0][1]


def _make_llm(args: argparse.Namespace):  # noqa: ANN202 - imports torch lazily
    from sessionserve import LLM

    return LLM(model=_single_model(args), kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads,
               dtype=args.dtype, device=args.device, **_spec_kwargs(args))


def cmd_serve(args: argparse.Namespace) -> None:
    if args.replicas > 1:  # several engine replicas behind the session-aware router, on Ray Serve
        from sessionserve.router.ray_app import serve_from_args

        args.model = _single_model(args)
        return serve_from_args(args)
    import logging
    from pathlib import Path

    import uvicorn

    from sessionserve.config import Config, ServerConfig, fold_cpu_host_tier
    from sessionserve.llm import resolve_model_path
    from sessionserve.llm_engine import LLMEngine
    from sessionserve.model.runner import resolve_device
    from sessionserve.obs.cpu_roles import parse_cpus
    from sessionserve.obs.tracing import Tracer, configure_logging
    from sessionserve.server import Auth, create_app

    configure_logging(logging.INFO)
    notes: list[str] = []

    def config(spool_dir: str | None) -> Config:
        built, note = fold_cpu_host_tier(Config.from_env(Config.from_kwargs(
            kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads, dtype=args.dtype,
            device=args.device, residency_policy=args.residency_policy, host_kv_bytes=args.host_kv_bytes,
            host_kv_int8=args.host_kv_int8,
            disk_kv_bytes=args.disk_kv_bytes, spool_dir=spool_dir, kv_store_dir=args.kv_store_dir,
            kv_store_bytes=args.kv_store_bytes, host_prefix_cache_bytes=args.host_prefix_cache_bytes,
            admission=args.admission, admission_fill=args.admission_fill,
            admission_when_full=args.admission_when_full, max_prefill_step_s=args.max_prefill_step_ms and
            args.max_prefill_step_ms / 1000, **_spec_kwargs(args))), resolve_device(args.device).type)
        if note and note not in notes:
            notes.append(note)
        return built

    specs = model_specs(args.model)
    names = args.served_model_name or []
    if len(specs) == 1:
        engines: dict[str, LLMEngine] = {
            names[0] if names else None: LLMEngine(config(args.spool_dir), resolve_model_path(specs[0][1]))}
        engines = {name or eng.model_dir.name: eng for name, eng in engines.items()}
    else:  # one engine per model, each with the engine flags (its own KV budget, tiers and spool folder)
        engines = {name: LLMEngine(config(args.spool_dir and str(Path(args.spool_dir) / name)),
                                   resolve_model_path(path)) for name, path in specs}
    default = next(iter(engines))
    aliases = {alias: default for alias in names if alias not in engines}
    server = ServerConfig(max_queued_requests=args.max_queued_requests, implicit_sessions=args.implicit_sessions,
                          tokenize_threads=args.tokenize_threads, response_store=args.response_store,
                          metrics_auth=args.metrics_auth)
    app = create_app(engines, auth=Auth.from_options(args.api_key, args.keys_file), tracer=Tracer(args.trace),
                     tokenize_cpus=parse_cpus(args.tokenize_cpus), engine_cpus=parse_cpus(args.engine_cpus),
                     aliases=aliases, config=server)
    print(startup_banner(engines, aliases, f"http://{args.host}:{args.port}", args, notes), flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=30,
                log_config=None)


def _size(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.1f} GiB" if num_bytes >= 1 << 30 else f"{num_bytes / (1 << 20):.0f} MiB"


def startup_banner(engines: dict, aliases: dict[str, str], url: str, args: argparse.Namespace,
                   notes: tuple[str, ...] | list[str] = ()) -> str:
    """What a newcomer needs on start: where the server is, what it serves with how much KV per tier, and
    how to point the agents and SDKs at it."""
    lines = [f"sessionserve is serving on {url}"]
    for name, eng in engines.items():
        also = [a for a, target in aliases.items() if target == name]
        kv = eng.kv_usage()
        device = kv["device_blocks_total"] * kv["block_bytes"]
        tokens = kv["device_blocks_total"] * eng.runner.block_size
        sc = eng.config.session
        host = f"{_size(sc.host_kv_bytes)}{' int8' if sc.host_kv_int8 else ''}" if sc.host_kv_bytes else "off"
        disk = f"{_size(sc.disk_kv_bytes)}" if sc.disk_kv_bytes else "off"
        dtype = str(eng.runner.dtype).removeprefix("torch.")
        lines.append(f"  model {name!r}{' (also ' + ', '.join(map(repr, also)) + ')' if also else ''}: "
                     f"{eng.model_dir}, context {eng.max_model_len} tokens, {dtype}")
        admission = eng.config.scheduler.admission
        lines.append(f"    KV cache: device {_size(device)} ({tokens:,} tokens), host tier {host}, disk tier {disk}; "
                     f"parked sessions: {sc.residency_policy} policy; admission: {admission}")
    lines += [f"    {note}" for note in notes]
    model = next(iter(engines))
    key = "<your API key>" if args.api_key or args.keys_file else "<any>"  # keys are never printed or logged
    lines += [
        "  Point clients at it:",
        f"    OpenAI SDKs (chat, Responses):  OPENAI_BASE_URL={url}/v1 OPENAI_API_KEY={key}  model={model!r}",
        f"    Anthropic SDK / Claude Code:    ANTHROPIC_BASE_URL={url} ANTHROPIC_API_KEY={key} "
        f"ANTHROPIC_MODEL={model} claude",
        f"    Codex (~/.codex/config.toml):   model = \"{model}\"  model_provider = \"sessionserve\"",
        f"                                    [model_providers.sessionserve] name = \"sessionserve\" "
        f"base_url = \"{url}/v1\" wire_api = \"responses\"",
    ]
    return "\n".join(lines)


def cmd_generate(args: argparse.Namespace) -> None:
    from sessionserve import SamplingParams

    llm = _make_llm(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if args.chat:
        for prompt in prompts:
            print(llm.chat([{"role": "user", "content": prompt}], params).text)
        return
    for out in llm.generate(prompts, params):
        print(out.text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sessionserve", description="An LLM inference server built for AI agents.")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("make-model", help="write the embedded default model (an HF folder)", add_help=False)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", action="append", default=None, help="accepted API key (repeatable)")
    serve.add_argument("--keys-file", default=None, help="JSON object mapping API keys to tenant names")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="names clients may use for the model: the first is the one /v1/models lists, the "
                            "others are aliases (e.g. the name a client is configured with)")
    serve.add_argument("--residency-policy", default="predictive",
                       choices=["discard", "keep", "ttl", "least-waste", "predictive"],
                       help="what happens to a parked session's KV (default: predictive, which keeps, moves "
                            "to a lower tier or drops each session by its expected wait and cost)")
    serve.add_argument("--admission", choices=ADMISSION_MODES, default="auto",
                       help="working-set: new sessions wait at the door while the active sessions' contexts fill "
                            "--admission-fill of the device KV, so returning turns keep their KV (no thrashing "
                            "past the knee); auto (default): so only while recomputing a session's context costs "
                            "more than an agent's tool wait, as measured while serving; off: every request runs "
                            "as it comes")
    serve.add_argument("--admission-fill", type=float, default=1.2,
                       help="share of the device KV the admitted sessions' contexts may fill")
    serve.add_argument("--admission-when-full", choices=("hold", "reject"), default="hold",
                       help="a new session's turn that must wait at the door: hold its request open until it is "
                            "let in (default), or reject it at once with 429 and Retry-After (when an admitted "
                            "session is expected to leave)")
    serve.add_argument("--host-kv-bytes", type=int, default=0,
                       help="host-memory KV tier for parked sessions (default 0: off). On a CPU it is the same "
                            "RAM as the device KV: without --host-kv-int8 its bytes are added to the device KV")
    serve.add_argument("--host-kv-int8", action="store_true",
                       help="store the host tier's KV as int8 with per-block scales (~4x the tokens per byte, a "
                            "small logit error)")
    serve.add_argument("--disk-kv-bytes", type=int, default=0)
    serve.add_argument("--spool-dir", default=None)
    serve.add_argument("--kv-store-dir", default=None,
                       help="folder shared by replicas (local or network file system): finished turns' KV is "
                            "written there and read by whichever replica continues the session")
    serve.add_argument("--kv-store-bytes", type=int, default=8 << 30, help="budget of --kv-store-dir")
    serve.add_argument("--host-prefix-cache-bytes", type=int, default=0,
                       help="host memory for KV blocks the device's prefix cache evicts (0: none)")
    serve.add_argument("--max-queued-requests", type=int, default=1024)
    serve.add_argument("--response-store", default=None,
                       help="where Responses API responses are kept for previous_response_id: "
                            "sqlite:///file.db, redis://host:port/db (default: SQLite in memory)")
    serve.add_argument("--tokenize-threads", type=int, default=2, help="threads that render and tokenize prompts")
    serve.add_argument("--max-prefill-step-ms", type=float, default=None,
                       help="while streams decode, prompt chunks batched with them take at most about this many "
                            "ms of a step (a bound on every stream's token gap, paid in a long prompt's time to "
                            "first token); default: only --max-num-batched-tokens bounds them")
    serve.add_argument("--tokenize-cpus", default=None, help="cores for those threads, e.g. '1' or '2-3'")
    serve.add_argument("--engine-cpus", default=None,
                       help="cores for the engine loop and its compute threads, e.g. '0' (default: any)")
    serve.add_argument("--implicit-sessions", choices=("chat", "all", "off"), default="chat",
                       help="requests without a session id continue the session of the conversation they extend: "
                            "chat requests (default), completions too (all), or none")
    serve.add_argument("--metrics-auth", choices=("none", "key"), default="none",
                       help="who may read /metrics, /openapi.json and /docs: anyone (none, the default: open "
                            "like a Prometheus scrape target) or only clients with a valid API key (key; send "
                            "it as 'Authorization: Bearer KEY', which a browser's /docs page cannot)")
    serve.add_argument("--replicas", type=int, default=1,
                       help="engine replicas on Ray Serve behind the session/KV-aware router (pip install .[ray])")
    serve.add_argument("--store", default=None,
                       help="session store for --replicas: sqlite:///file.db (default) or redis://host:port/db")
    serve.add_argument("--trace", choices=["console", "otlp"], default=None,
                       help="export OpenTelemetry spans per request and session step")
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate text for prompts (arguments or stdin lines)")
    _engine_args(gen)
    gen.add_argument("prompt", nargs="*")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    gen.set_defaults(func=cmd_generate)

    from sessionserve import cli_bench

    bench = sub.add_parser("bench", help="replay an agent trace, compare residency policies, write a report")
    cli_bench.add_bench_arguments(bench)
    bench.set_defaults(func=cli_bench.run_bench)

    merge = sub.add_parser("merge-reports", help="one load sweep from several bench runs' report folders")
    cli_bench.add_merge_arguments(merge)
    merge.set_defaults(func=cli_bench.run_merge)

    demo = sub.add_parser("demo", help="a short agent-trace replay on the embedded default model, with a report")
    cli_bench.add_demo_arguments(demo)
    demo.set_defaults(func=cli_bench.run_demo)

    from sessionserve import cli_sim

    cli_sim.add_subcommands(sub)  # calibrate, simulate, plan

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "make-model":
        from sessionserve.modelgen.make_model import main as make_model_main

        make_model_main(argv[1:])
        return
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
