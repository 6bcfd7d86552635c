"""Generate text with a Grok-1-style model, streaming tokens as they are produced.

    python run.py                                   # the shipped default model, a default prompt
    python run.py --prompt "It is a truth"          # one prompt
    python run.py < prompts.txt                     # one prompt per line, batched over the slots
    python run.py --checkpoint DIR [--config grok-1]  # a native or original-layout checkpoint
    python run.py serve [--checkpoint DIR] [--host 127.0.0.1] [--port 8000]  # the OpenAI-compatible server

Ends with a summary line on stderr: time to first token, output tokens/s, compilations.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # the start's phases count from here (imports included)

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

DEFAULT_PROMPT = "It is a truth universally acknowledged, that"
COMPILE_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "grok-runner",
                             "compiled")
INT32_MAX, UINT32_MAX = 2**31 - 1, 2**32 - 1


def bounded(kind, low=None, high=None, what=""):
    """An argparse type: ``kind`` (int or float) within [low, high], finite; the message says what is expected."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what or kind.__name__}, got {text!r}") from None
        if value != value or value in (float("inf"), float("-inf")) or (low is not None and value < low) or (
                high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


def open_unit(text):
    """A float in (0, 1]: top-p."""
    value = bounded(float, what="a number in (0, 1]")(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="checkpoint directory: native (config.json) or original Grok-1 "
                   "layout (ckpt-0/); default: the model shipped in checkpoints/")
    p.add_argument("--config", help="config for an original-layout checkpoint: a preset name "
                   "(grok-1, grok-1-reference-tiny, tiny) or a JSON file")
    p.add_argument("--tokenizer", help="SentencePiece model (default: the checkpoint's tokenizer.model)")
    p.add_argument("--prompt", help="prompt text; without it, prompts are read from piped stdin, one per "
                   f"line, else the default {DEFAULT_PROMPT!r}")
    p.add_argument("--prompt-ids", help="prompt as comma-separated token ids (no tokenizer needed)")
    p.add_argument("--max-tokens", type=bounded(int, 1, INT32_MAX, "an integer >= 1"), default=100,
                   help="tokens to generate per prompt (default 100)")
    p.add_argument("--temperature", type=bounded(float, 0, None, "a finite number >= 0"), default=0.8,
                   help="0 = greedy; higher = more random (default 0.8)")
    p.add_argument("--top-p", type=open_unit, default=0.95, help="nucleus sampling mass in (0, 1]; 1 = off (default 0.95)")
    p.add_argument("--top-k", type=bounded(int, 0, INT32_MAX, "an integer in [0, 2**31 - 1]"), default=0,
                   help="sample among the k most likely tokens; 0 = off")
    p.add_argument("--seed", type=bounded(int, 0, UINT32_MAX, "an integer in [0, 2**32 - 1]"), default=0,
                   help="random seed; the same seed gives the same text (default 0); prompt i gets seed + i")
    p.add_argument("--batch-size", type=bounded(int, 1, 1 << 16, "an integer >= 1"), default=None,
                   help="decode slots (default: 1 per device)")
    p.add_argument("--pad-sizes", help="comma-separated prompt buckets (default: powers of two from 16 up to the "
                   "round's token budget, 512, or sequence_len if shorter)")
    p.add_argument("--mesh", default=None, help="device mesh DATA,MODEL (default 1,1)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="activation dtype (default: the checkpoint's "
                   "on accelerators, float32 on CPU). bfloat16 is Grok-1's own: bf16 weights and activations, "
                   "softmax, norms and the router in float32; on CPU the bf16 kernels read half of float32's "
                   "bytes and multiply on AVX512-BF16 where the CPU has it")
    p.add_argument("--kv-dtype", choices=["float32", "bfloat16", "int8"], default=None,
                   help="what the KV cache holds (default: the activation dtype); int8 keeps one float32 scale a "
                   "token and KV head, 3.8x the tokens of float32 in the same memory at key_size 64, at the "
                   "error BENCHMARKS.md measures")
    p.add_argument("--speculative", type=bounded(int, 0, 16, "an integer in [0, 16]"), default=0,
                   help="speculative decoding by n-gram lookup: verify up to this many tokens a step drafted from "
                   "the prompt and output (greedy output unchanged, sampled output keeps its distribution); helps "
                   "where the output repeats its context (BENCHMARKS.md); 0 = off (default)")
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="quantise the float weights of the experts and attention projections to int8 at load "
                   "(per output channel); on one CPU device the int8 kernels then read a quarter of the bytes a "
                   "step (BENCHMARKS.md measures the speed and the logit error). int8 checkpoints (the shipped "
                   "model, Grok-1) are read as int8 without it")
    p.add_argument("--backend", choices=["auto", "xla", "cpu"], default="auto",
                   help="where the operations run (backends/): xla is pure JAX on any devices; cpu is one CPU "
                   "device with every C++ kernel; auto (default) is cpu on one CPU device with each kernel "
                   "taken only where measured faster than XLA's op on this CPU (once per machine, cached), "
                   "xla elsewhere")
    p.add_argument("--compile-cache", default=COMPILE_CACHE,
        help="directory of compiled steps (runner/executables.py), so a second start of the same model "
             "and settings loads them instead of compiling (default: %(default)s); 'off' disables it")
    p.add_argument("--plan", action="store_true", help="print the per-device memory plan and exit "
                   "(with --preset or --checkpoint, --mesh, --batch-size, --device-memory)")
    p.add_argument("--preset", help="plan for a preset config (grok-1, ...) in the Grok-1 release's "
                   "dtypes (int8 matrices, bf16 scales, float32 embedding) instead of a checkpoint")
    p.add_argument("--device-memory", type=bounded(float, 0, None, "a number of GiB > 0"),
                   help="memory of one device in GiB, for --plan")
    p.add_argument("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
                   help="multi-host: coordinator HOST:PORT for jax.distributed.initialize "
                   "(env JAX_COORDINATOR_ADDRESS), or 'auto' where JAX detects the cluster (Cloud TPU, SLURM)")
    p.add_argument("--num-processes", type=int, default=_env_int("JAX_NUM_PROCESSES"),
                   help="multi-host: number of processes (env JAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=_env_int("JAX_PROCESS_ID"),
                   help="multi-host: this process's id (env JAX_PROCESS_ID)")
    return p, p.parse_args(argv)


def _env_int(name):
    value = os.environ.get(name)
    return int(value) if value else None


def plan(parser, args) -> int:
    from checkpoints import CheckpointError
    from checkpoints.restore import abstract_checkpoint
    from model import PRESETS
    from model.plan import abstract_params, memory_plan

    mesh = int_list(parser, "--mesh", args.mesh) if args.mesh else [1, 1]
    if args.preset:
        if args.preset not in PRESETS:
            parser.error(f"--preset must be one of {sorted(PRESETS)}, got {args.preset!r}")
        config = PRESETS[args.preset]
        params = abstract_params(config, quantized=True)
    elif args.checkpoint:
        try:
            config, params = abstract_checkpoint(args.checkpoint, args.config)
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        parser.error("--plan needs --preset NAME or --checkpoint DIR")
    if args.dtype:
        import dataclasses

        config = dataclasses.replace(config, fprop_dtype=args.dtype)
    memory = None if args.device_memory is None else int(args.device_memory * 2**30)
    try:
        result = memory_plan(config, params, mesh_shape=tuple(mesh), batch_size=args.batch_size or 1,
                             device_memory=memory, kv_dtype=args.kv_dtype)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.format())
    return 0


def pad_sizes_of(parser, text):
    """``--pad-sizes``: positive integers, or None for the runner's default."""
    if not text:
        return None
    sizes = int_list(parser, "--pad-sizes", text)
    if min(sizes) < 1:
        parser.error(f"argument --pad-sizes: expected positive integers, got {text!r}")
    return sizes


def int_list(parser, flag, text):
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"{flag} must be comma-separated integers, got {text!r}")
    if not values:
        parser.error(f"{flag} is empty")
    return values


def start_jax(parser, args) -> None:
    """Join the other processes (several hosts); on several, JAX's persistent compilation cache."""
    import jax

    if args.coordinator == "auto":
        jax.distributed.initialize()  # Cloud TPU, SLURM, ...: JAX finds the cluster itself
    elif args.coordinator or args.num_processes:
        if not (args.coordinator and args.num_processes and args.process_id is not None):
            parser.error("multi-host needs --coordinator, --num-processes and --process-id (or their env vars)")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    if args.compile_cache != "off" and jax.process_count() > 1:
        # several hosts compile (the store of compiled steps is one process's): JAX's persistent
        # cache then skips XLA's part of it on a second start
        jax.config.update("jax_compilation_cache_dir", os.path.join(args.compile_cache, "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def prefix_cache_of(args) -> dict:
    """The runner's prefix cache settings for ``--prefix-cache-gb`` (by default, as many blocks
    of 16 positions as the slots hold positions)."""
    if args.prefix_cache_gb is None:
        return {"prefix_cache_blocks": "auto"}
    return {"prefix_cache_bytes": int(args.prefix_cache_gb * 1e9)}


def serve(argv) -> int:
    """``run.py serve``: the OpenAI-compatible HTTP server (server/) on a checkpoint."""
    p = argparse.ArgumentParser(prog="run.py serve", description="Serve a checkpoint over the OpenAI API "
                                "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, "
                                "/tokenize, /detokenize).")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the shipped model)")
    p.add_argument("--config", help="config for an original-layout checkpoint: a preset name or a JSON file")
    p.add_argument("--tokenizer", help="SentencePiece model (default: the checkpoint's tokenizer.model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=bounded(int, 0, 65535, "a port in [0, 65535]"), default=8000, help="port (default 8000)")
    p.add_argument("--model-name", help="the model's name in the API (default: the checkpoint directory's name)")
    p.add_argument("--api-key", default=os.environ.get("GROK_RUNNER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (env GROK_RUNNER_API_KEY)")
    p.add_argument("--batch-size", type=bounded(int, 1, 1 << 16, "an integer >= 1"), default=8,
                   help="decode slots (default 8)")
    p.add_argument("--max-waiting", type=bounded(int, 0, None, "an integer >= 0"), default=256,
                   help="requests that may wait for a slot; beyond, 503 with Retry-After (default 256); a "
                   "request of more choices than --batch-size + --max-waiting is a 400")
    p.add_argument("--max-body-bytes", type=bounded(int, 1, None, "an integer >= 1"), default=4 << 20,
                   help="largest request body, counted as it arrives (chunked or not); beyond, 413 "
                   "(default 4194304)")
    p.add_argument("--decode-steps", type=bounded(int, 1, 64, "an integer in [1, 64]"), default=2,
                   help="decode steps per device call in a round without prompt work (default 2): more "
                   "amortise the host's work per call, fewer let a new request in sooner")
    p.add_argument("--max-scored-tokens", type=bounded(int, 0, None, "an integer >= 0"), default=None,
                   help="prompt tokens one request may have scored (echo with logprobs), computed as part "
                   "of its prefill; default: --batch-size x the model's sequence_len; 0: echo with logprobs "
                   "is refused and its scoring prefill variants are not compiled")
    p.add_argument("--read-timeout", type=bounded(float, 0.001, None, "a number of seconds > 0"), default=15.0,
                   help="seconds a client may take to send a request's head, or between two pieces of its "
                   "body; then its connection is closed and logged (default 15)")
    p.add_argument("--keep-alive-timeout", type=bounded(float, 0.001, None, "a number of seconds > 0"),
                   default=5.0, help="seconds an idle connection is kept between requests (default 5)")
    p.add_argument("--shutdown-timeout", type=bounded(float, 0.001, None, "a number of seconds > 0"),
                   default=10.0, help="on SIGTERM or Ctrl-C, seconds requests in flight may take to finish; "
                   "then they end with an error and the server exits, rc 0 (default 10; a second signal "
                   "exits at once, rc 1)")
    p.add_argument("--private-docs-and-metrics", action="store_true",
                   help="with --api-key, require the key for /metrics, /docs, /redoc and /openapi.json too "
                   "(only /health stays public)")
    p.add_argument("--pad-sizes", help="comma-separated prompt buckets, each compiled at start; prompts are cut into "
                   "chunks of those no larger than --max-num-batched-tokens (default: powers of two from 16 up "
                   "to that budget, or sequence_len if shorter)")
    p.add_argument("--max-num-batched-tokens", type=bounded(int, 1, INT32_MAX, "an integer >= 1"),
                   help="tokens a round may compute: prompt chunks (cut to buckets no larger) plus one per "
                   "decoding request; admitting a long prompt holds running streams for one such round "
                   "(default: the runner's, runner.runner.DEFAULT_BATCHED_TOKENS)")
    p.add_argument("--prefix-cache-gb", type=bounded(float, 0, None, "a number of GB >= 0"), default=None,
                   help="device memory for the prefix cache, in GB (10**9 bytes): the KV of prompt prefixes in "
                   "blocks of 16 positions, reused by requests whose prompts start with the same tokens, least "
                   "recently used evicted first; 0 turns it off (default: as much as the slots' own KV, "
                   "--batch-size x sequence_len positions)")
    p.add_argument("--kv-dtype", choices=["float32", "bfloat16", "int8"], default=None,
                   help="what the KV cache holds (default: the activation dtype); int8 keeps one float32 scale a "
                   "token and KV head, 3.8x the tokens of float32 in the same memory at key_size 64, at the "
                   "error BENCHMARKS.md measures")
    p.add_argument("--quantize", choices=["int8"], default=None, help="see run.py --help")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="see run.py --help")
    p.add_argument("--speculative", type=bounded(int, 0, 16, "an integer in [0, 16]"), default=0,
                   help="the most draft tokens a speculative step verifies, and the default of every request "
                   "(the request's \"speculative\" field may ask for fewer, or 0); 0 = off (default); see run.py --help")
    p.add_argument("--backend", choices=["auto", "xla", "cpu"], default="auto", help="see run.py --help")
    p.add_argument("--compile-cache", default=COMPILE_CACHE,
                   help="directory of compiled steps ('off' disables it); see run.py --help")
    p.add_argument("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
                   help="several hosts: coordinator HOST:PORT (process 0 serves HTTP, the others follow it)")
    p.add_argument("--num-processes", type=int, default=_env_int("JAX_NUM_PROCESSES"))
    p.add_argument("--process-id", type=int, default=_env_int("JAX_PROCESS_ID"))
    p.add_argument("--mesh", default=None, help="device mesh DATA,MODEL (default 1,1)")
    args = p.parse_args(argv)
    if not 0 < args.port < 65536:
        p.error(f"--port must be in [1, 65535], got {args.port}")
    if args.batch_size <= 0:
        p.error(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.max_waiting < 0:
        p.error(f"--max-waiting must be >= 0, got {args.max_waiting}")
    mesh = int_list(p, "--mesh", args.mesh) if args.mesh else [1, 1]
    if len(mesh) != 2:
        p.error(f"--mesh must be DATA,MODEL, got {args.mesh!r}")
    if args.private_docs_and_metrics and not args.api_key:
        p.error("--private-docs-and-metrics needs --api-key (or GROK_RUNNER_API_KEY)")
    pad_sizes = pad_sizes_of(p, args.pad_sizes)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("grok_runner.server").setLevel(logging.INFO)  # closed connections, clients gone, drain
    start_jax(p, args)
    import jax

    from checkpoints import CheckpointError
    from checkpoints.materialize import resolve_config
    from runner import InferenceRunner, ModelRunner
    from runner.compile_count import compilations
    from runner.runner import default_checkpoint
    from runner.startup import stderr_startup
    from server import Limits, Server, serve_forever
    from server.starting import Starting

    checkpoint = args.checkpoint or default_checkpoint()
    if checkpoint is None or not os.path.isdir(checkpoint):
        p.error(f"--checkpoint {checkpoint!r} is not a directory")
    compilations()  # counted from here: a start that loads every step compiles nothing
    startup = stderr_startup(STARTED)
    startup.mark("imports", STARTED)
    limits = Limits(read_timeout=args.read_timeout, keep_alive_timeout=args.keep_alive_timeout,
                    shutdown_timeout=args.shutdown_timeout)

    def build() -> Server:
        """The model ready, and the server over it (``SystemExit(2)`` saying why if it cannot be)."""
        try:
            config = None if args.config is None else resolve_config(args.config)  # a preset name or a JSON file
            runner = InferenceRunner(runner=ModelRunner(checkpoint_path=checkpoint, model=config,
                                                        backend=args.backend, kv_dtype=args.kv_dtype,
                                                        quantize=args.quantize, dtype=args.dtype),
                                     tokenizer_path=args.tokenizer, batch_size=args.batch_size,
                                     local_mesh_config=tuple(mesh), pad_sizes=pad_sizes,
                                     score_prompts=args.max_scored_tokens != 0, decode_steps=args.decode_steps,
                                     speculative=args.speculative, compile_cache=compile_cache_of(args),
                                     **({} if args.max_num_batched_tokens is None
                                        else {"max_num_batched_tokens": args.max_num_batched_tokens}),
                                     **prefix_cache_of(args))
            runner = runner.initialize(startup=startup)
            if jax.process_index() != 0:
                return runner
            with startup.phase("server"):
                server = Server(runner, args.model_name or os.path.basename(os.path.normpath(checkpoint)),
                                api_key=args.api_key, max_waiting=args.max_waiting,
                                max_body_bytes=args.max_body_bytes, max_scored_tokens=args.max_scored_tokens,
                                private_docs_and_metrics=args.private_docs_and_metrics)
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

    starting = Starting(startup)

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


def report(runner) -> None:
    """The backend, each CPU kernel's choice and the KV cache, on stderr."""
    for line in runner.backend_report().splitlines():
        print(line if line.startswith("backend:") else f"  kernel {line}", file=sys.stderr)
    print(runner.kv_report(), file=sys.stderr)


def compile_cache_of(args):
    """The directory of compiled steps for ``--compile-cache`` (None: off)."""
    return None if args.compile_cache == "off" else args.compile_cache


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    parser, args = parse_args(argv)
    start = time.perf_counter()
    if args.plan:
        return plan(parser, args)
    if args.prompt is not None and not args.prompt.strip():
        parser.error("argument --prompt: expected text, got an empty prompt")
    try:
        return generate(parser, args, start)
    except KeyboardInterrupt:
        print(f"\ninterrupted after {time.perf_counter() - start:.2f} s", file=sys.stderr)
        return 130


def generate(parser, args, start: float) -> int:
    """``run.py`` without a subcommand: every flag checked, then the model loaded and the prompts streamed."""
    checkpoint, config, prompt_ids = args.checkpoint, args.config, args.prompt_ids
    mesh = int_list(parser, "--mesh", args.mesh) if args.mesh else [1, 1]
    if len(mesh) != 2 or min(mesh) < 1:
        parser.error(f"argument --mesh: expected DATA,MODEL (two positive integers), got {args.mesh!r}")
    pad_sizes = pad_sizes_of(parser, args.pad_sizes)
    if prompt_ids is not None:
        prompts = [int_list(parser, "--prompt-ids", prompt_ids)]
    elif args.prompt is not None:
        prompts = [args.prompt]
    else:
        piped = sys.stdin is not None and not sys.stdin.isatty()
        prompts = [line.rstrip("\r\n") for line in sys.stdin if line.strip()] if piped else []  # CRLF too
        prompts = prompts or [DEFAULT_PROMPT]  # nothing piped in: the default prompt
    if args.seed + len(prompts) - 1 > UINT32_MAX:
        parser.error(f"argument --seed: prompt {len(prompts) - 1} would get seed {args.seed + len(prompts) - 1}, "
                     "past 2**32 - 1")
    from runner import Request

    try:
        requests = [Request(p, temperature=args.temperature, nucleus_p=args.top_p, top_k=args.top_k,
                            rng_seed=args.seed + i, max_len=args.max_tokens) for i, p in enumerate(prompts)]
    except ValueError as e:
        parser.error(str(e))
    start_jax(parser, args)
    from checkpoints import CheckpointError
    from runner import InferenceRunner, ModelRunner
    from runner.compile_count import compilations
    from runner.runner import default_checkpoint
    from runner.startup import stderr_startup

    compilations()
    startup = stderr_startup(STARTED)
    startup.mark("imports", STARTED)
    if checkpoint is None:
        checkpoint = default_checkpoint()
        if checkpoint is None:
            parser.error("the default model checkpoints/austen-moe/ is missing: pass --checkpoint DIR")
    if not os.path.isdir(checkpoint):
        parser.error(f"argument --checkpoint: {checkpoint!r} is not a directory")
    try:
        runner = InferenceRunner(
            runner=ModelRunner(checkpoint_path=checkpoint, model=config, dtype=args.dtype, backend=args.backend,
                               kv_dtype=args.kv_dtype, quantize=args.quantize),
            tokenizer_path=args.tokenizer, local_mesh_config=tuple(mesh), pad_sizes=pad_sizes,
            batch_size=args.batch_size, speculative=args.speculative, compile_cache=compile_cache_of(args))
        runner = runner.initialize(startup=startup)
        for r in requests:
            runner.prepare(r)
    except (ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report(runner)
    print(f"{startup.summary()}; {compilations()} XLA compilations", file=sys.stderr, flush=True)

    single = len(requests) == 1
    texts = {r.request_id: [] for r in requests}
    index = {r.request_id: i for i, r in enumerate(requests)}
    first_token = None
    generated = 0
    interrupted = False
    try:
        for event in runner.run(requests):
            if first_token is None:
                first_token = time.perf_counter()
            generated += event.token_id is not None
            text = event.text if runner.tokenizer is not None else (
                f"{event.token_id}," if event.token_id is not None else "")
            if single:
                if event.index == 0 and event.token_id is not None:
                    print(prompts[0] if isinstance(prompts[0], str) else "", end="", flush=True)
                print(text, end="", flush=True)
            else:
                texts[event.request_id].append(text)
                if event.finish_reason:
                    i = index[event.request_id]
                    print(f"[{i}] {prompts[i]}{''.join(texts[event.request_id])}", flush=True)
    except KeyboardInterrupt:  # Ctrl-C: the summary of what was generated, exit 130
        interrupted = True
    end = time.perf_counter()
    if single:
        print()
    ttft = (first_token or end) - start
    rate = max(generated - len(requests), 0) / max(end - (first_token or end), 1e-9)
    print(("\ninterrupted: " if interrupted else "") + f"time to first token {ttft:.2f} s (command start, "
          f"compile included), {rate:.1f} tokens/s after it ({generated} tokens, {len(requests)} prompts, batch "
          f"{runner.num_slots}), {compilations()} compilations", file=sys.stderr)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
