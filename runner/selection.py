"""Which backend (``backends/``) a runner uses, and why: ``choose("auto" | "xla" | "cpu", ...)``."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from backends import XLA, Backend

BACKENDS = ("auto", "xla", "cpu")


@dataclasses.dataclass(frozen=True)
class Selection:
    """The backend chosen, why, and for the CPU backend each operation's ``Choice`` (measured,
    forced, or declined with the reason)."""

    backend: Backend
    reason: str
    choices: dict = dataclasses.field(default_factory=dict)

    def report(self) -> str:
        lines = [f"backend: {self.backend.describe()} ({self.reason})"]
        lines += [choice.describe() for choice in self.choices.values()]
        return "\n".join(lines)


def _place(mesh) -> tuple[str, int]:
    return mesh.devices.flat[0].platform, mesh.size


def one_cpu_device(mesh) -> bool:
    """Whether ``mesh`` is one CPU device: where the CPU backend runs."""
    return _place(mesh) == ("cpu", 1)


def start(requested: str, mesh) -> None:
    """Before restoring a checkpoint: start building the CPU kernels in the background where the
    CPU backend may take them, so the compiler runs while the weights load."""
    if requested != "xla" and one_cpu_device(mesh):
        from backends.cpu import build

        build.prebuild()


def choose(requested: str, mesh, config, params, batch: int, calibration_tokens: int | None = None,
           kv_dtype=None, w8a8: bool = False) -> Selection:
    """The backend for ``config`` and its canonical ``params`` served on ``mesh`` with ``batch`` slots
    and a KV cache of ``kv_dtype`` (default: the activations'). With ``w8a8`` (``--quantize w8a8``)
    the int8 weights may take the int8 x int8 kernels: all of them with ``"cpu"``, each where
    measured faster than the exact int8 kernel with ``"auto"``; XLA multiplies exactly.

    - ``"xla"``: pure JAX, on any mesh.
    - ``"cpu"``: one CPU device and every C++ kernel; ``ValueError`` saying why where that cannot
      run (another device or several, no compiler, activations neither float32 nor bf16, heads
      the attention kernel does not take).
    - ``"auto"``: the CPU backend on one CPU device, each kernel taken only where it was measured
      faster than XLA's op on this CPU at this model's shapes (``backends.cpu.calibration``, cached
      beside the kernel library); XLA elsewhere.
    """
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    platform, size = _place(mesh)
    if requested == "xla":
        return Selection(XLA.for_platform(platform), "backend='xla'")
    if not one_cpu_device(mesh):
        where = f"the mesh has {size} {platform} device{'s' if size > 1 else ''}"
        if requested == "cpu":
            raise ValueError(f"backend='cpu' runs on one CPU device; {where}")
        return Selection(XLA.for_platform(platform), f"auto: {where}")

    from backends.cpu import CPU, OPERATIONS, build, calibration

    c = config
    needs, int8_weights = _blockers(config, params, kv_dtype)
    kv_dtype = jnp.dtype(c.dtype if kv_dtype is None else kv_dtype).name
    dtype = jnp.dtype(c.fprop_dtype).name
    if requested == "cpu":
        blocked = {op: why for op, why in needs.items() if why}
        if blocked:
            raise ValueError("backend='cpu' takes every CPU kernel, and " + "; ".join(
                f"{op} needs {', '.join(why)}" for op, why in blocked.items()))
        choices = {op: calibration.Choice(op, True, reason="backend='cpu'", int8=op in int8_weights,
                                          w8a8=w8a8 and op in int8_weights) for op in OPERATIONS}
        return Selection(CPU(on=frozenset(OPERATIONS), int8=frozenset(int8_weights),
                             w8a8=frozenset(int8_weights) if w8a8 else frozenset(), dtype=dtype), "backend='cpu'",
                         choices)
    choices = {op: calibration.Choice(op, False, reason="it needs " + "; ".join(why)) for op, why in needs.items() if why}
    to_measure = [op for op in OPERATIONS if op not in choices]
    counts = {"shapes": 0, "measured": 0}
    if to_measure:
        tokens = calibration_tokens or min(256, c.sequence_len)
        choices.update(calibration.calibrate(to_measure, c, batch, tokens, tokens, kv_dtype=kv_dtype,
                                             int8_weights=frozenset(int8_weights), dtype=dtype, counts=counts,
                                             w8a8=w8a8))
    choices = {op: choices[op] for op in OPERATIONS}
    on = frozenset(op for op, choice in choices.items() if choice.kernel)
    int8 = frozenset(op for op, choice in choices.items() if choice.int8)
    chosen_w8a8 = frozenset(op for op, choice in choices.items() if choice.w8a8)
    calibrated = ("every shape read from the cache" if not counts["measured"] else
                  f"{counts['measured']} of {counts['shapes']} shapes measured now, cached for the next start")
    in_place = build.available()  # the KV cache's writes and prefill reads: never slower in place (CPU.kv_in_place)
    return Selection(CPU(on=on, int8=int8, w8a8=chosen_w8a8, dtype=dtype, kv_in_place=in_place),
                     f"auto: one CPU device; each kernel where measured faster here; calibration: {calibrated}",
                     choices)


def _blockers(config, params, kv_dtype) -> tuple[dict, set]:
    """Why each CPU kernel cannot run for ``config`` and its ``params`` (an empty list: it can), and
    the operations whose weights are all int8."""
    from backends.cpu import OPERATIONS, build, calibration
    from backends.cpu.layout import MOE_WEIGHT, PROJECTION, weight_dtypes
    from backends.cpu.ops import MAX_GROUP, MAX_HEAD, decode_attention_fits

    c = config
    needs = {op: [] for op in OPERATIONS}  # why each kernel cannot run here
    reason = build.unavailable_reason()
    for op in OPERATIONS:
        if reason:
            needs[op].append(reason)
    dtype = jnp.dtype(c.fprop_dtype).name
    for op in calibration.WEIGHT_OPERATIONS:
        if dtype not in ("float32", "bfloat16"):
            needs[op].append(f"float32 or bf16 activations (they are {dtype})")
    int8_weights = set()
    for op, pattern, what in (("moe", MOE_WEIGHT, "experts"), ("projections", PROJECTION, "attention projections")):
        held = weight_dtypes(params, pattern)  # float weights are held in the activations' dtype (prepare)
        if held - {"float32", "bfloat16", "int8"}:
            needs[op].append(f"float or int8 {what}, and these are {', '.join(sorted(held))}")
        elif held == {"int8"}:
            int8_weights.add(op)  # timed on the int8 kernel against the float kernel on the dequantised copy
        elif "int8" in held:
            needs[op].append(f"{what} all float or all int8, and these are {', '.join(sorted(held))}")
    if not decode_attention_fits(c.num_q_heads, c.num_kv_heads, c.key_size):
        needs["attention"].append(f"head sizes up to {MAX_HEAD} and at most {MAX_GROUP} query heads a KV head")
    kv_dtype = jnp.dtype(c.dtype if kv_dtype is None else kv_dtype).name
    if kv_dtype not in ("float32", "bfloat16", "int8"):
        needs["attention"].append(f"a float32, bf16 or int8 KV cache (it is {kv_dtype})")
    return needs, int8_weights
