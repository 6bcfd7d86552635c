"""Which kernels a runner takes (backends/cpu/calibration.py): a kernel measured slower is never
taken, the measurement is cached, naming a backend skips it, and the AVX2 build is correct."""

import json
import os
import platform
import subprocess
import sys

import jax
import numpy as np
import pytest

from backends.cpu import OPERATIONS, build, calibration, ops as panel
from backends.cpu.calibration import Measurement
from backends.cpu.layout import ExpertWeights
from model import TINY
from runner import Executor, ModelRunner
from tests import COMPILE_FAST
from tests.helpers import first_layer

needs_kernel = pytest.mark.skipif(not build.available(), reason=f"CPU kernels: {build.unavailable_reason()}")


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A kernel cache of this test's own (the library is built again into it only if missing)."""
    monkeypatch.setenv("GROK_RUNNER_KERNEL_CACHE", str(tmp_path))
    lib = build.library_path()
    assert lib.parent == tmp_path
    return lib.with_suffix(".calibration.json")


def test_a_kernel_is_taken_only_where_it_is_faster_at_every_shape():
    fast = Measurement("decode", 8, kernel_s=1.0, xla_s=2.0)
    slow = Measurement("prefill", 256, kernel_s=3.0, xla_s=2.0)
    assert calibration.decide("moe", [fast]).kernel
    assert not calibration.decide("moe", [fast, slow]).kernel  # a decode win does not buy a prefill loss
    assert not calibration.decide("moe", [Measurement("decode", 1, 2.0, 2.0)]).kernel  # a tie keeps XLA
    described = calibration.decide("moe", [fast, slow]).describe()
    assert described == "moe: XLA (kernel speed / XLA's: decode 8 rows 2.00x, prefill 256 rows 0.67x)"


def test_an_int8_kernel_is_taken_only_where_it_beats_xla_and_the_float_kernel():
    def m(phase, speedup):
        return Measurement(phase, 8, kernel_s=1.0 / speedup, xla_s=1.0)

    # a bandwidth-bound decode: int8 reads a quarter of the bytes; prefill's multiplications tie
    chosen = calibration.decide_int8("moe", [m("decode", 3.0), m("prefill", 0.97)], [m("decode", 2.0), m("prefill", 1.5)])
    assert chosen.kernel and chosen.int8
    assert chosen.describe() == ("moe: int8 kernel (int8 kernel speed / float kernel's: decode 8 rows 3.00x, prefill "
                                 "8 rows 0.97x; kernel speed / XLA's: decode 8 rows 2.00x, prefill 8 rows 1.50x)")
    # a prefill tie measured a little under the float kernel is still a tie (INT8_TOLERANCE); a
    # clear loss is not
    assert calibration.decide_int8("moe", [m("decode", 1.65), m("prefill", 0.92)],
                                   [m("decode", 2.0), m("prefill", 1.5)]).int8
    assert not calibration.decide_int8("moe", [m("decode", 1.65), m("prefill", 0.85)],
                                       [m("decode", 2.0), m("prefill", 1.5)]).int8
    # float weights in cache: the float kernel wins, and the weights are dequantised for it
    chosen = calibration.decide_int8("moe", [m("decode", 0.5), m("prefill", 1.0)], [m("decode", 7.0), m("prefill", 3.0)])
    assert chosen.kernel and not chosen.int8 and chosen.describe().startswith("moe: kernel on the dequantised copy")
    # the int8 kernel beats the float one, but not XLA's op at one shape (0.8 x 1.2 < 1)
    chosen = calibration.decide_int8("moe", [m("decode", 3.0), m("prefill", 1.2)], [m("decode", 2.0), m("prefill", 0.8)])
    assert not chosen.kernel and not chosen.int8
    assert chosen.describe().startswith("moe: XLA's dot on the dequantised copy")


@needs_kernel
def test_the_runner_declines_a_kernel_the_calibration_finds_slower(tiny_params, private_cache, monkeypatch):
    slower = {"moe", "unembed", "sampling_cut", "attention"}

    def measure(shapes):
        measure.calls += 1
        return [Measurement(phase, rows, 2.0, 1.0) if op in slower else Measurement(phase, rows, 1.0, 2.0)
                for op, phase, rows, _ in shapes]

    measure.calls = 0
    monkeypatch.setattr(calibration, "_measure", measure)
    engine = ModelRunner(model=TINY, params=tiny_params, backend="auto")
    engine = Executor.create(engine)
    assert measure.calls == 1
    assert engine.selection.backend.on == set(OPERATIONS) - slower, engine.backend_report()
    layer = first_layer(engine.params)
    assert isinstance(layer["moe"]["linear"]["w"], ExpertWeights)  # XLA's layout for the slower MoE
    assert isinstance(layer["multi_head_attention"]["query"]["w"], panel.PanelWeight)  # the faster projections
    assert not isinstance(engine.params["language_model"]["in_out_embed"]["embeddings"], panel.PanelTable)
    assert "moe: XLA (kernel speed / XLA's: decode 1 rows 0.50x, prefill 64 rows 0.50x)" in engine.backend_report()
    # the attention on XLA's op, and the cache still written in place (never slower than a scatter)
    assert engine.selection.backend.kv_in_place and "KV cache written and read in place" in engine.backend_report()

    # the measurement is cached beside the library: a second runner of the same shapes only reads it
    cached = json.loads(private_cache.read_text())
    assert len(cached) == 8 and all(entry["kernel_s"] > 0 for entry in cached.values())
    again = ModelRunner(model=TINY, params=tiny_params, backend="auto")
    again = Executor.create(again)
    first, second = engine.backend_report().splitlines(), again.backend_report().splitlines()
    assert measure.calls == 1 and first[1:] == second[1:]  # the same choices, from the cache
    assert "calibration: 8 of 8 shapes measured now" in first[0]
    assert "calibration: every shape read from the cache" in second[0]
    # another batch size is another shape: measured once more
    Executor.create(ModelRunner(model=TINY, params=tiny_params, bs_per_device=2, backend="auto"))
    assert measure.calls == 2

    # the model still computes the same with its mixed layouts
    tokens = np.array([[5, 9, 13, 2]], np.int32)
    xla = ModelRunner(model=TINY, params=tiny_params, backend="xla")
    xla = Executor.create(xla)
    lengths = np.array([4], np.int32)
    np.testing.assert_allclose(engine.forward(engine.params, tokens, lengths),
                               xla.forward(xla.params, tokens, lengths), atol=1e-4, rtol=1e-4)


@needs_kernel
def test_naming_a_backend_never_measures(tiny_params, private_cache, monkeypatch):
    def measure(shapes):
        raise AssertionError("measured although the backend was named")

    monkeypatch.setattr(calibration, "_measure", measure)
    forced = ModelRunner(model=TINY, params=tiny_params, backend="cpu")
    forced = Executor.create(forced)
    assert forced.selection.backend.on == set(OPERATIONS)
    assert "moe: kernel (backend='cpu')" in forced.backend_report()
    off = ModelRunner(model=TINY, params=tiny_params, backend="xla")
    off = Executor.create(off)
    assert off.selection.choices == {} and off.selection.backend.name == "xla"
    assert not private_cache.exists()


@needs_kernel
def test_a_real_calibration_times_every_operation(private_cache):
    choices = calibration.calibrate(OPERATIONS, TINY, 2, 16, 16)
    assert list(choices) == list(OPERATIONS)
    for op, choice in choices.items():
        assert choice.measurements and all(m.kernel_s > 0 and m.xla_s > 0 for m in choice.measurements), op
        assert choice.kernel == all(m.kernel_s < m.xla_s for m in choice.measurements)
    assert [m.phase for m in choices["moe"].measurements] == ["decode", "prefill"]
    assert len(json.loads(private_cache.read_text())) == 8


def test_a_torn_cache_file_is_measured_again(private_cache, monkeypatch):
    private_cache.parent.mkdir(parents=True, exist_ok=True)
    private_cache.write_text("{not json")
    monkeypatch.setattr(calibration, "_measure", lambda shapes: [Measurement(p, r, 1.0, 2.0) for _, p, r, _ in shapes])
    choices = calibration.calibrate(["attention"], TINY, 1, 16, 16)
    assert choices["attention"].kernel
    assert len(json.loads(private_cache.read_text())) == 1
    with pytest.raises(ValueError, match="unknown operation 'matmul'"):
        calibration.calibrate(["matmul"], TINY, 1, 16, 16)


AVX2_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from backends.cpu import build, ops as panel
from model.quant import dequantize, quantize
assert build.available(), build.unavailable_reason()
rng = np.random.default_rng(0)
for rows in range(0, 15):
    for k, n in ((64, 96), (33, 37)):
        x = rng.standard_normal((rows, k), np.float32)
        w = rng.standard_normal((k, n), np.float32)
        got = np.asarray(panel.panel_matmul(jnp.asarray(x), jnp.asarray(panel.pack(w)), n))
        np.testing.assert_allclose(got, x @ w, rtol=1e-4, atol=1e-4)
        q = quantize(jnp.asarray(w), groups=1 if k == 33 else 4)
        held = panel.Int8PanelWeight.of(q)
        got = np.asarray(panel.int8_panel_matmul(jnp.asarray(x), held.panels, held.scales, n))
        np.testing.assert_allclose(got, x @ np.asarray(dequantize(q, jnp.float32)), rtol=1e-4, atol=1e-4)
        q = quantize(jnp.asarray(w), groups=1 if k == 33 else 2)  # groups of whole blocks of 32
        held = panel.W8A8PanelWeight.of(q)  # no VNNI in x86-64-v3: the emulated int8 dot, 1 row a pass
        got = np.asarray(panel.w8a8_panel_matmul(jnp.asarray(x), held.panels, held.comp, held.scales, n))
        want = panel.w8a8_reference(x, np.asarray(q.weight), np.asarray(q.scales, np.float32))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
assert build.int8_dot() == "emulated", build.int8_dot()
print("ok", build.library_path().name)
"""


def _has_avx512() -> bool:
    try:
        return " avx512f" in open("/proc/cpuinfo").read()
    except OSError:
        return True  # unknown: build the AVX2 variant to be sure


@needs_kernel
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64-v3 is an x86 target")
@pytest.mark.skipif(not _has_avx512(), reason="no AVX-512 here: the native build is the AVX2 variant, "
                    "which every kernel test runs")
def test_the_avx2_build_of_the_panel_kernel_is_exact(other_march_kernels):
    """Built for AVX2 (``-march=x86-64-v3``; 16 vector registers, so 3 rows a pass instead of 8),
    every row count from 0 to 14 takes the blocks and remainders of that variant."""
    env = dict(os.environ, GROK_RUNNER_KERNEL_MARCH="x86-64-v3", GROK_RUNNER_KERNEL_CACHE=other_march_kernels,
               JAX_PLATFORMS="cpu", XLA_FLAGS=COMPILE_FAST)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok kernels-")
    assert jax.devices()  # the parent's backend is untouched
