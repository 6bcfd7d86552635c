"""The command's flag table: each flag defined once, in groups the subcommands share.

``model`` (what to load and how), ``sampling`` (generate's defaults), ``cluster`` (several hosts),
``serving`` (the HTTP server) and ``operations`` (logs, CORS). Values are checked as they are
parsed: a bad one is one ``PROG: error: ...`` line naming the flag, exit 2, before anything loads.
"""

from __future__ import annotations

import argparse
import os

INT32_MAX, UINT32_MAX = 2**31 - 1, 2**32 - 1
# the compiled steps' store: $GROK_RUNNER_COMPILE_CACHE (as InferenceRunner.compile_cache), else the user's cache
COMPILE_CACHE = os.environ.get("GROK_RUNNER_COMPILE_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "grok-runner", "compiled")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


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


def int_list(text):
    """Comma-separated integers."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


def mesh_shape(text):
    """``DATA,MODEL``: two positive integers."""
    try:
        values = int_list(text)
    except argparse.ArgumentTypeError:
        values = []
    if len(values) != 2 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected DATA,MODEL (two positive integers), got {text!r}")
    return tuple(values)


def pad_sizes(text):
    """Prompt buckets: positive integers."""
    values = int_list(text)
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def origins(text):
    """``--allowed-origins``: comma-separated origins (scheme://host[:port]) or ``*``."""
    values = [o.strip() for o in text.split(",") if o.strip()]
    for origin in values:
        if origin != "*" and ("://" not in origin or origin.endswith("/")):
            raise argparse.ArgumentTypeError(f"expected origins like https://example.com or *, got {origin!r}")
    if not values:
        raise argparse.ArgumentTypeError(f"expected origins like https://example.com or *, got {text!r}")
    return values


def _env_int(name):
    value = os.environ.get(name)
    return int(value) if value else None


def checkpoint(p: argparse.ArgumentParser) -> None:
    """Where the model comes from (every subcommand that reads one)."""
    p.add_argument("--checkpoint", help="checkpoint directory: native (config.json) or original Grok-1 "
                   "layout (ckpt-0/); default: the model shipped with the package (austen-moe)")
    p.add_argument("--config", help="config for an original-layout checkpoint: a preset name "
                   "(grok-1, grok-1-reference-tiny, tiny) or a JSON file")
    p.add_argument("--tokenizer", help="SentencePiece model (default: the checkpoint's tokenizer.model; for "
                   "the original layout, tokenizer.model beside ckpt-0/ or one directory up)")


def model(p: argparse.ArgumentParser, batch_size: int | None, batch_help: str) -> None:
    """How the model is loaded and run: generate and serve."""
    checkpoint(p)
    p.add_argument("--mesh", type=mesh_shape, default=(1, 1), help="device mesh DATA,MODEL (default 1,1)")
    p.add_argument("--batch-size", type=bounded(int, 1, 1 << 16, "an integer >= 1"), default=batch_size,
                   help=f"decode slots ({batch_help})")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="activation dtype (default: the checkpoint's "
                   "on accelerators, float32 on CPU). bfloat16 is Grok-1's own: bf16 weights and activations, "
                   "softmax, norms and the router in float32; on CPU the bf16 kernels read half of float32's "
                   "bytes and multiply on AVX512-BF16 where the CPU has it")
    p.add_argument("--kv-dtype", choices=["float32", "bfloat16", "int8"], default=None,
                   help="what the KV cache holds (default: the activation dtype); int8 keeps one float32 scale a "
                   "token and KV head, 3.8x the tokens of float32 in the same memory at key_size 64")
    p.add_argument("--quantize", choices=["int8", "w8a8"], default=None,
                   help="quantise the float weights of the experts and attention projections to int8 at load "
                   "(per output channel); int8 checkpoints (the shipped model, Grok-1) are read as int8 without it. "
                   "w8a8: int8 weights (an int8 checkpoint's as they are) that the CPU kernels may multiply by the "
                   "activations rounded to int8 per block of 32, as llama.cpp's q8_0 does (AVX512-VNNI or AVX-VNNI), "
                   "where measured faster than the exact int8 kernel: not Grok-1's exact product (its error: "
                   "BENCHMARKS.md); the backend line logs which was taken")
    p.add_argument("--backend", choices=["auto", "xla", "cpu"], default="auto",
                   help="where the operations run: xla is pure JAX on any devices; cpu is one CPU device with "
                   "every C++ kernel; auto (default) is cpu on one CPU device with each kernel taken only where "
                   "measured faster than XLA's op on this CPU (once per machine, cached), xla elsewhere")
    pad_sizes_flag(p)
    p.add_argument("--compile-cache", default=COMPILE_CACHE,
                   help="directory of compiled steps, so a second start of the same model and settings loads "
                   "them instead of compiling (default: %(default)s); 'off' disables it")
    cluster(p)


def cluster(p: argparse.ArgumentParser) -> None:
    """Several hosts (``jax.distributed``)."""
    p.add_argument("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
                   help="several hosts: coordinator HOST:PORT for jax.distributed.initialize "
                   "(env JAX_COORDINATOR_ADDRESS), or 'auto' where JAX detects the cluster (Cloud TPU, SLURM)")
    p.add_argument("--num-processes", type=int, default=_env_int("JAX_NUM_PROCESSES"),
                   help="several hosts: number of processes (env JAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=_env_int("JAX_PROCESS_ID"),
                   help="several hosts: this process's id (env JAX_PROCESS_ID)")


def pad_sizes_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pad-sizes", type=pad_sizes, help="comma-separated prompt buckets, each compiled at start "
                   "(default: powers of two from 16 up to the round's token budget, or sequence_len if shorter)")


def scheduling(p: argparse.ArgumentParser) -> None:
    """How a server plans its rounds, which decides the steps it compiles: serve, and plan (which counts them)."""
    p.add_argument("--decode-steps", type=bounded(int, 1, 64, "an integer in [1, 64]"), default=2,
                   help="decode steps per device call in a round without prompt work (default 2): more "
                   "amortise the host's work per call, fewer let a new request in sooner")
    p.add_argument("--max-scored-tokens", type=bounded(int, 0, None, "an integer >= 0"), default=None,
                   help="prompt tokens one request may have scored (echo with logprobs), computed as part "
                   "of its prefill; default: --batch-size x the model's sequence_len; 0: echo with logprobs "
                   "is refused and its scoring prefill variants are not compiled")
    p.add_argument("--max-num-batched-tokens", type=bounded(int, 1, INT32_MAX, "an integer >= 1"),
                   help="tokens a round may compute: prompt chunks (cut to buckets no larger) plus one per "
                   "decoding request (default 512)")


def speculative(p: argparse.ArgumentParser, help_: str) -> None:
    p.add_argument("--speculative", type=bounded(int, 0, 16, "an integer in [0, 16]"), default=0, help=help_)


def plan(p: argparse.ArgumentParser) -> None:
    """The memory plan's own flags (with ``model``'s --checkpoint, --config, --mesh, --batch-size)."""
    p.add_argument("--preset", help="plan for a preset config (grok-1, ...) in the Grok-1 release's "
                   "dtypes (int8 matrices, bf16 scales, float32 embedding) instead of a checkpoint")
    p.add_argument("--device-memory", type=bounded(float, 0, None, "a number of GiB > 0"),
                   help="memory of one device in GiB")


def operations(p: argparse.ArgumentParser) -> None:
    """Logs and cross-origin access: serve."""
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="the server's log level (default info: start-up, closed connections, stats lines)")
    p.add_argument("--access-log", action="store_true",
                   help="log a line per request: client, method, path, status and milliseconds (off by default)")
    p.add_argument("--stats-interval", type=bounded(float, 0, None, "a number of seconds >= 0"), default=10.0,
                   help="seconds between the stats lines (running and waiting requests, prompt and generation "
                   "tokens/s, KV use), logged while there is activity; 0 = off (default 10)")
    p.add_argument("--allowed-origins", type=origins, default=None,
                   help="comma-separated origins whose browser pages may call the API (CORS), or '*'; off by "
                   "default: cross-origin requests are refused")
