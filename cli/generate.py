"""``grok-runner [generate]``: stream continuations of prompts.

    grok-runner                                   # the shipped model, a default prompt
    grok-runner --prompt "It is a truth"          # one prompt
    grok-runner < prompts.txt                     # one prompt per line, batched over the slots
    grok-runner --checkpoint DIR [--config grok-1]  # a native, Hugging Face or original-layout checkpoint

Ends with a summary line on stderr: time to first token, output tokens/s, compilations.
"""

from __future__ import annotations

import argparse
import sys
import time

from cli import STARTED, flags
from cli.common import checkpoint_of, compile_cache_of, inspect_checkpoint, report, start_jax

DEFAULT_PROMPT = "It is a truth universally acknowledged, that"


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", help="prompt text; without it, prompts are read from piped stdin, one per "
                   f"line, else the default {DEFAULT_PROMPT!r}")
    p.add_argument("--prompt-ids", type=flags.int_list, help="prompt as comma-separated token ids (no tokenizer "
                   "needed)")
    p.add_argument("--max-tokens", type=flags.bounded(int, 1, flags.INT32_MAX, "an integer >= 1"), default=100,
                   help="tokens to generate per prompt (default 100)")
    p.add_argument("--temperature", type=flags.bounded(float, 0, None, "a finite number >= 0"), default=0.8,
                   help="0 = greedy; higher = more random (default 0.8)")
    p.add_argument("--top-p", type=flags.open_unit, default=0.95,
                   help="nucleus sampling mass in (0, 1]; 1 = off (default 0.95)")
    p.add_argument("--top-k", type=flags.bounded(int, 0, flags.INT32_MAX, "an integer in [0, 2**31 - 1]"), default=0,
                   help="sample among the k most likely tokens; 0 = off")
    p.add_argument("--seed", type=flags.bounded(int, 0, flags.UINT32_MAX, "an integer in [0, 2**32 - 1]"), default=0,
                   help="random seed; the same seed gives the same text (default 0); prompt i gets seed + i")
    flags.model(p, None, "default: 1 per device")
    flags.speculative(p, "speculative decoding by n-gram lookup: verify up to this many tokens a step drafted "
                      "from the prompt and output (greedy output unchanged, sampled output keeps its "
                      "distribution); 0 = off (default)")
    return p


def generate(argv, prog: str) -> int:
    p = parser(prog)
    args = p.parse_args(argv)
    start = time.perf_counter()
    if args.prompt is not None and not args.prompt.strip():
        p.error("argument --prompt: expected text, got an empty prompt")
    try:
        return _generate(p, args, start)
    except KeyboardInterrupt:
        print(f"\ninterrupted after {time.perf_counter() - start:.2f} s", file=sys.stderr)
        return 130
    except SystemExit as e:
        return e.code


def _prompts(p, args) -> list:
    if args.prompt_ids is not None:
        return [args.prompt_ids]
    if args.prompt is not None:
        return [args.prompt]
    piped = sys.stdin is not None and not sys.stdin.isatty()
    prompts = [line.rstrip("\r\n") for line in sys.stdin if line.strip()] if piped else []  # CRLF too
    return prompts or [DEFAULT_PROMPT]  # nothing piped in: the default prompt


def _generate(p, args, start: float) -> int:
    """Every flag checked, the checkpoint's headers read, then the model loaded and the prompts streamed."""
    prompts = _prompts(p, args)
    if args.seed + len(prompts) - 1 > flags.UINT32_MAX:
        p.error(f"argument --seed: prompt {len(prompts) - 1} would get seed {args.seed + len(prompts) - 1}, "
                "past 2**32 - 1")
    from runner import Request

    try:
        requests = [Request(q, temperature=args.temperature, nucleus_p=args.top_p, top_k=args.top_k,
                            rng_seed=args.seed + i, max_len=args.max_tokens) for i, q in enumerate(prompts)]
    except ValueError as e:
        p.error(str(e))
    checkpoint = checkpoint_of(p, args)
    text = any(isinstance(q, str) for q in prompts)
    inspected = inspect_checkpoint(checkpoint, args, need_tokenizer=text)
    start_jax(p, args)
    from checkpoints import CheckpointError
    from runner import InferenceRunner, ModelRunner
    from runner.compile_count import compilations
    from runner.startup import stderr_startup

    compilations()
    startup = stderr_startup(STARTED)
    startup.mark("imports", STARTED)
    try:
        runner = InferenceRunner(
            runner=ModelRunner(checkpoint_path=checkpoint, model=args.config, dtype=args.dtype, backend=args.backend,
                               kv_dtype=args.kv_dtype, quantize=args.quantize),
            tokenizer_path=inspected.tokenizer_path, local_mesh_config=args.mesh, pad_sizes=args.pad_sizes,
            batch_size=args.batch_size, speculative=args.speculative, compile_cache=compile_cache_of(args))
        # The steps the prompts call, made ready as they are first called (loaded from the store of
        # compiled steps, else compiled), not the whole ladder a server warms: a command knows its
        # requests, and one prompt calls a prefill and a decode step or two of the nine.
        runner = runner.initialize(warmup=False, startup=startup)
        for r in requests:
            runner.prepare(r)
    except (ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report(runner)
    print(f"{startup.summary()}; {compilations()} XLA compilations", file=sys.stderr, flush=True)
    return _stream(runner, requests, prompts, start, compilations)


def _stream(runner, requests, prompts, start, compilations) -> int:
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
