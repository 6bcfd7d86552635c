"""What the benchmarks share: the benchmark config, timing, serving a batch through ``run()``, a
busy decode state, and the name of the CPU (every figure says which CPU it came from)."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import jax
import numpy as np

from model import TINY
from runner import InferenceRunner, Request


BENCH = dataclasses.replace(
    TINY, vocab_size=32768, emb_size=512, key_size=64, num_q_heads=8, num_kv_heads=2, num_layers=8,
    widening_factor=8, num_experts=8, num_selected_experts=2, sequence_len=2048,
    embedding_multiplier_scale=512 ** 0.5, attn_output_multiplier=64 ** -0.5, fprop_dtype="float32")


def expected_experts(batch: int, config) -> float:
    """Distinct experts a batch of tokens touches per layer, on average (uniform routing)."""
    e, k = config.num_experts, config.num_selected_experts
    return e * (1 - (1 - k / e) ** batch)


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def serve(runner: InferenceRunner, batch: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
    """Submit ``batch`` requests at once and time their tokens.

    TPOT is per request, first token excluded, as served: it includes the decode steps a request
    waits while later requests are prefilled (one at a time). Steady decode is the batch's own
    rate once every slot decodes: tokens emitted between the last request's first token and the
    first request's last token, over that time.
    """
    rng = np.random.default_rng(seed)
    requests = [Request(rng.integers(4, runner.config.vocab_size, prompt_len).tolist(), temperature=0.0,
                        max_len=new_tokens, stop_token_ids=()) for _ in range(batch)]
    submitted = time.perf_counter()
    first, last, times = {}, {}, []
    for event in runner.run(requests):
        now = time.perf_counter()
        first.setdefault(event.request_id, now)
        last[event.request_id] = now
        if event.token_id is not None:
            times.append(now)
    end = time.perf_counter()
    ttft = [first[r.request_id] - submitted for r in requests]
    tpot = [(last[r.request_id] - first[r.request_id]) / max(new_tokens - 1, 1) for r in requests]
    start, stop = max(first.values()), min(last.values())
    steady = sum(start < t <= stop for t in times) / (stop - start) if stop > start else float("nan")
    return {"ttft": statistics.median(ttft), "tpot": statistics.median(tpot), "decode_tokens_per_s": steady,
            "output_tokens_per_s": len(times) / (end - submitted)}


def busy(engine, state, position: int, tokens: np.ndarray):
    """``state`` with every slot active at ``position``, its next input ``tokens[slot]``: a decode
    step from it attends over ``position + 1`` positions. Tokens that differ by row route rows to
    different experts, as in serving (identical rows would all read the same two). A step donates
    its state and moves it on, so timing loops call this again before every step."""
    sh, b = engine._state_shardings, len(tokens)
    return state.replace(
        memory=state.memory.replace(step=jax.device_put(np.full((b,), position, np.int32), sh.memory.step)),
        active=jax.device_put(np.ones((b,), bool), sh.active), tokens=jax.device_put(tokens, sh.tokens),
        remaining=jax.device_put(np.full((b,), 10**6, np.int32), sh.remaining))


def cpu() -> str:
    """The CPU's model name and its widest vector extension."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    extras = [label for flag, label in (("avx512_bf16", "AVX512-BF16"), ("avx512_vnni", "AVX512-VNNI"),
                                        ("avx_vnni", "AVX-VNNI"), ("amx_bf16", "AMX-BF16"), ("amx_int8", "AMX-INT8"))
              if flag in flags]
    return f"{name}, {isa}" + "".join(f", {label}" for label in extras) + f", {os.cpu_count()} threads"


