"""``ModelRunner``: which model to serve and how (the Grok-1 reference runner's name for it).

A frozen description: the model config, where its parameters come from (a checkpoint directory,
or a pytree the caller already has), the mesh and sharding rules, the precision, the KV cache's
dtype and the backend. ``Executor.create(spec, mesh, batch_size)`` (``runner/executor.py``) turns
it into parameters on the mesh and compiled steps; ``InferenceRunner.initialize`` does that for
code written against the reference.
"""

from __future__ import annotations

import dataclasses
import os

from jax.sharding import Mesh

from model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ModelRunner:
    """Either ``checkpoint_path`` (restored by ``Executor.create``) or ``params`` (a pytree the
    caller already has, with ``model``; no file I/O) must be given. ``bs_per_device`` sizes the
    batch as in the reference."""

    model: ModelConfig | None = None
    checkpoint_path: str | None = None
    params: dict | None = None
    bs_per_device: float = 1.0
    mesh: Mesh | None = None
    rules: dict | None = None
    # Activation dtype override: "float32" or "bfloat16" (Grok-1's own: softmax, norms, RoPE and
    # the router stay float32). From a checkpoint on CPU the default is float32; with "bfloat16"
    # the float weights are restored in bf16 and the CPU backend's bf16 kernels read them.
    dtype: str | None = None
    # int8 weights -> float at load. Default: with the CPU backend on one CPU device, int8 weights
    # stay int8 and the int8 panel kernels read them where the calibration takes them (the rest
    # are dequantised once, by the backend's prepare); with XLA on a CPU, dequantised at load;
    # kept int8 elsewhere.
    dequantize: bool | None = None
    # Quantise the float weights of the experts and attention projections to int8 at load:
    # None, or "int8" (symmetric, per output channel, float32 scales: model.quant.quantize_params),
    # or "w8a8": int8 weights as "int8" (an int8 checkpoint's as they are), which the CPU kernels
    # may multiply by the activations rounded to int8 per block of 32 (llama.cpp's q8_0 dot, on
    # AVX512-VNNI or AVX-VNNI) where the calibration measures that faster than the exact int8
    # kernel: not Grok-1's exact product (its error: BENCHMARKS.md); XLA multiplies exactly.
    quantize: str | None = None
    # What the KV cache (and the prefix pool) holds: None, the activations' dtype; "int8", int8
    # values and a float32 scale a token and KV head (model.memory.QuantizedKV): 3.8x the tokens
    # of a float32 cache in the same bytes at key_size 64, at a bounded error (README).
    kv_dtype: str | None = None
    # Where the operations run (backends/): "xla" (pure JAX, any mesh), "cpu" (one CPU device, every
    # C++ kernel; ValueError where it cannot run), or "auto": the CPU backend on one CPU device
    # with each kernel taken only where measured faster than XLA's op on this CPU, XLA elsewhere.
    # Default: $GROK_RUNNER_BACKEND, else "auto" (the variable runs a whole program, or the test
    # suite, on one backend).
    backend: str = dataclasses.field(default_factory=lambda: os.environ.get("GROK_RUNNER_BACKEND") or "auto")
    # Prompt tokens per prefill call and cache positions per decode step that the calibration
    # times the kernels at (default: 256 of each, or sequence_len if shorter).
    calibration_tokens: int | None = None
