"""``grok-runner serve``: the OpenAI-compatible HTTP server (server/) on a checkpoint.

The port opens at once: /health answers 503 with the start's phase until the model is ready, every
other path 503 with Retry-After. Then /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics, /tokenize, /detokenize and a chat page at /.
"""

from __future__ import annotations

import argparse
import os
import sys

from cli import STARTED, flags
from cli.common import checkpoint_of, compile_cache_of, inspect_checkpoint, report, start_jax


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=flags.bounded(int, 1, 65535, "a port in [1, 65535]"), default=8000,
                   help="port (default 8000)")
    p.add_argument("--model-name", help="the model's name in the API (default: the checkpoint directory's name)")
    p.add_argument("--api-key", default=os.environ.get("GROK_RUNNER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (env GROK_RUNNER_API_KEY)")
    p.add_argument("--chat-template", help="a Jinja2 chat template file (default: the checkpoint's "
                   "chat_template.jinja, else a plain 'Role: content' template)")
    p.add_argument("--chat-template-seconds", type=flags.bounded(float, 0.001, None, "a number of seconds > 0"),
                   default=None, help="time a chat template may take to render one request's messages; "
                   "past it the request is a 400 (default 1)")
    p.add_argument("--chat-template-chars", type=flags.bounded(int, 1, None, "an integer >= 1"), default=None,
                   help="characters a chat template may write for one request; past them, or asked to build "
                   "a longer string, the request is a 400 (default 4,000,000)")
    flags.model(p, 8, "default 8")
    p.add_argument("--max-waiting", type=flags.bounded(int, 0, None, "an integer >= 0"), default=256,
                   help="requests that may wait for a slot; beyond, 503 with Retry-After (default 256); a "
                   "request of more choices than --batch-size + --max-waiting is a 400")
    p.add_argument("--max-body-bytes", type=flags.bounded(int, 1, None, "an integer >= 1"), default=4 << 20,
                   help="largest request body, counted as it arrives (chunked or not); beyond, 413 "
                   "(default 4194304)")
    flags.scheduling(p)
    p.add_argument("--prefix-cache-gb", type=flags.bounded(float, 0, None, "a number of GB >= 0"), default=None,
                   help="device memory for the prefix cache, in GB (10**9 bytes): the KV of prompt prefixes in "
                   "blocks of 16 positions, reused by requests whose prompts start with the same tokens; 0 "
                   "turns it off (default: as much as the slots' own KV)")
    flags.speculative(p, "the most draft tokens a speculative step verifies, and the default of every request "
                      "(the request's \"speculative\" field may ask for fewer, or 0); 0 = off (default)")
    p.add_argument("--read-timeout", type=flags.bounded(float, 0.001, None, "a number of seconds > 0"), default=15.0,
                   help="seconds a client may take to send a request's head, or between two pieces of its "
                   "body; then its connection is closed and logged (default 15)")
    p.add_argument("--keep-alive-timeout", type=flags.bounded(float, 0.001, None, "a number of seconds > 0"),
                   default=5.0, help="seconds an idle connection is kept between requests (default 5)")
    p.add_argument("--shutdown-timeout", type=flags.bounded(float, 0.001, None, "a number of seconds > 0"),
                   default=10.0, help="on SIGTERM or Ctrl-C, seconds requests in flight may take to finish; "
                   "then they end with an error and the server exits, rc 0 (default 10; a second signal "
                   "exits at once, rc 1)")
    p.add_argument("--private-docs-and-metrics", action="store_true",
                   help="with --api-key, require the key for /metrics, /docs, /redoc and /openapi.json too "
                   "(only /health stays public)")
    flags.operations(p)
    return p


def prefix_cache_of(args) -> dict:
    """The runner's prefix cache settings for ``--prefix-cache-gb`` (by default, as many blocks
    of 16 positions as the slots hold positions)."""
    if args.prefix_cache_gb is None:
        return {"prefix_cache_blocks": "auto"}
    return {"prefix_cache_bytes": int(args.prefix_cache_gb * 1e9)}


def runner_of(args, checkpoint: str, tokenizer_path):
    """The ``InferenceRunner`` (not initialised) that serve's flags ``args`` describe: what ``serve``
    starts and ``grok-runner compile`` compiles the steps of."""
    from runner import InferenceRunner, ModelRunner

    return InferenceRunner(runner=ModelRunner(checkpoint_path=checkpoint, model=args.config, backend=args.backend,
                                              kv_dtype=args.kv_dtype, quantize=args.quantize, dtype=args.dtype),
                           tokenizer_path=tokenizer_path, batch_size=args.batch_size, local_mesh_config=args.mesh,
                           pad_sizes=args.pad_sizes, score_prompts=args.max_scored_tokens != 0,
                           decode_steps=args.decode_steps, speculative=args.speculative,
                           compile_cache=compile_cache_of(args),
                           **({} if args.max_num_batched_tokens is None
                              else {"max_num_batched_tokens": args.max_num_batched_tokens}),
                           **prefix_cache_of(args))


def serve(argv, prog: str) -> int:
    p = parser(prog)
    args = p.parse_args(argv)
    if args.private_docs_and_metrics and not args.api_key:
        p.error("--private-docs-and-metrics needs --api-key (or GROK_RUNNER_API_KEY)")
    from server import configure_logging

    configure_logging(args.log_level)
    checkpoint = checkpoint_of(p, args)
    try:
        inspected = inspect_checkpoint(checkpoint, args, need_tokenizer=True)
        template = _chat_template(args, checkpoint)
    except SystemExit as e:
        return e.code
    start_jax(p, args)
    import jax

    from checkpoints import CheckpointError
    from runner.compile_count import compilations
    from runner.startup import stderr_startup
    from server import Limits, Server, serve_forever
    from server.app import edge
    from server.starting import Starting

    compilations()  # counted from here: a start that loads every step compiles nothing
    startup = stderr_startup(STARTED)
    startup.mark("imports", STARTED)
    limits = Limits(read_timeout=args.read_timeout, keep_alive_timeout=args.keep_alive_timeout,
                    shutdown_timeout=args.shutdown_timeout)

    def build() -> Server:
        """The model ready, and the server over it (``SystemExit(2)`` saying why if it cannot be)."""
        try:
            runner = runner_of(args, checkpoint, inspected.tokenizer_path).initialize(startup=startup)
            if jax.process_index() != 0:
                return runner
            with startup.phase("server"):
                server = Server(runner, args.model_name or os.path.basename(os.path.normpath(checkpoint)),
                                api_key=args.api_key, max_waiting=args.max_waiting,
                                max_body_bytes=args.max_body_bytes, max_scored_tokens=args.max_scored_tokens,
                                private_docs_and_metrics=args.private_docs_and_metrics, chat_template=template,
                                **_operations(args))
        except (ValueError, CheckpointError) as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        report(runner)
        return server

    if jax.process_index() != 0:  # several hosts: follow process 0's rounds until it stops
        try:
            runner = build()
        except SystemExit as e:
            return e.code
        runner.engine.broadcast = True
        print(f"process {jax.process_index()}: following process 0", file=sys.stderr)
        runner.engine.follow()
        jax.distributed.shutdown()
        return 0

    starting = Starting(startup, edge(args.allowed_origins, args.access_log))

    def build_and_attach() -> None:
        server = build()
        with startup.phase("server"):
            starting.attach(server)
        print(f"serving {server.model_name} on http://{args.host}:{args.port}/v1 (a chat page at "
              f"http://{args.host}:{args.port}/)", file=sys.stderr)
        print(f"{startup.summary()}; {compilations()} XLA compilations", file=sys.stderr, flush=True)

    # The port opens now: /health says which phase the start is in until the model is ready
    print(f"starting on http://{args.host}:{args.port} (/health answers 503 until the model is ready)",
          file=sys.stderr, flush=True)
    rc = serve_forever(starting, args.host, args.port, limits, build=build_and_attach)  # until Ctrl-C or SIGTERM
    if jax.process_count() > 1 and rc == 0:
        jax.distributed.shutdown()
    return rc


def _chat_template(args, checkpoint: str):
    """``--chat-template``'s file, else the checkpoint's own template, compiled now with the
    budgets of ``--chat-template-seconds`` and ``--chat-template-chars`` (``SystemExit(2)`` naming
    the file if it is not a template)."""
    from server.chat import OUTPUT_BUDGET, TIME_BUDGET, ChatTemplate

    budgets = dict(time_budget=args.chat_template_seconds or TIME_BUDGET,
                   output_budget=args.chat_template_chars or OUTPUT_BUDGET)
    try:
        if args.chat_template is None:
            return ChatTemplate.for_checkpoint(checkpoint, **budgets)
        return ChatTemplate.from_file(args.chat_template, **budgets)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _operations(args) -> dict:
    """The server's keyword arguments for --access-log, --stats-interval and --allowed-origins."""
    return {"access_log": args.access_log, "stats_interval": args.stats_interval,
            "allowed_origins": args.allowed_origins}
