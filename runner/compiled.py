"""What a server compiles before it serves, known before anything is loaded: the steps an
``InferenceRunner``'s settings make its scheduler ask for (``steps``), and an estimate of their
compile time from compiling a few of them on abstract shapes here (``estimate``): ``grok-runner
plan`` reports both, so Grok-1's start can be judged on a laptop.
"""

from __future__ import annotations

import dataclasses
import time

import jax

from model.config import ModelConfig
from runner.engine import serving_variants
from runner.executor import Executor
from runner.model_runner import ModelRunner
from runner.runner import InferenceRunner


@dataclasses.dataclass(frozen=True)
class Steps:
    """The variants a server compiles: prefills ``(rows, bucket, score)``, decodes
    ``(KV length, steps, speculative)``, and the fork and the release (one each)."""

    prefills: list
    decodes: list
    pad_sizes: tuple
    kv_buckets: tuple

    @property
    def count(self) -> int:
        return len(self.prefills) + len(self.decodes) + 2

    def describe(self) -> str:
        scored = sum(1 for p in self.prefills if p[-1])
        return (f"{self.count} steps: {len(self.prefills)} prefill ({scored} of them scoring prompts), "
                f"{len(self.decodes)} decode, a fork and a release; prompt buckets "
                f"{','.join(map(str, self.pad_sizes))}, KV buckets {','.join(map(str, self.kv_buckets))}")


def steps(config: ModelConfig, batch_size: int, *, pad_sizes=None, max_num_batched_tokens: int | None = None,
          decode_steps: int = 2, speculative: int = 0, score_prompts: bool = False, live_keys: bool = False) -> Steps:
    """The steps a server of ``config`` with these ``InferenceRunner`` settings compiles at start
    (``Engine.compile``), from the same checks and scheduler; ``ValueError`` naming a bad setting.
    ``live_keys``: on a backend whose decode attention reads the live positions alone
    (``Backend.decode_reads_live_keys``), whose decode steps attend over one KV length."""
    fields = {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    spec = InferenceRunner(runner=ModelRunner(model=config), pad_sizes=pad_sizes, batch_size=batch_size,
                           decode_steps=decode_steps, speculative=speculative, score_prompts=score_prompts,
                           **fields)
    spec._check_fields()
    scheduler = spec._scheduler(config, batch_size, kv_buckets=(config.sequence_len,) if live_keys else None)
    prefills, decodes = serving_variants(scheduler, score_prompts)
    return Steps(prefills, decodes, scheduler.chunk_sizes, scheduler.kv_buckets)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Seconds to lower and compile the largest prefill and decode steps, the fork and the
    release here, and what all of ``steps`` would take at those rates."""

    prefill_s: float
    decode_s: float
    other_s: float
    total_s: float
    device: str

    def describe(self) -> str:
        return (f"compile estimate on this machine ({self.device}, XLA, one device; a bound from the largest steps): "
                f"{self.prefill_s:.1f} s a prefill, {self.decode_s:.1f} s a decode, {self.other_s:.1f} s "
                f"the fork and release: about {_duration(self.total_s)} for all")


def estimate(config: ModelConfig, params, plan: Steps, batch_size: int, kv_dtype: str | None = None) -> Estimate:
    """Compile the largest prefill and decode of ``plan`` (most positions, longest KV), the fork
    and the release of a server of ``config`` with abstract ``params`` on this host's first device
    (``Executor.abstract``: nothing allocated), and scale each to its kind's count. Compiling is
    the cost of a first start; an accelerator compiles at another speed than this machine."""
    mesh = jax.sharding.Mesh([[jax.devices()[0]]], ("data", "model"))
    executor = Executor.abstract(config, params, mesh, batch_size, kv_dtype=kv_dtype)
    largest_prefill = max(plan.prefills, key=lambda p: (p[0] * p[1], p[2]))
    largest_decode = max(plan.decodes, key=lambda d: (d[0], d[1], d[2]))
    seconds = {}
    for key, _, lower in executor.variants([largest_prefill], [largest_decode]):
        began = time.perf_counter()
        lower().compile()
        seconds[key[0]] = seconds.get(key[0], 0.0) + time.perf_counter() - began
    other = seconds["fork"] + seconds["release"]
    total = len(plan.prefills) * seconds["prefill"] + len(plan.decodes) * seconds["decode"] + other
    return Estimate(seconds["prefill"], seconds["decode"], other, total, _device_name(jax.devices()[0]))


def _device_name(device) -> str:
    if device.platform != "cpu":
        return device.device_kind
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "cpu"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
