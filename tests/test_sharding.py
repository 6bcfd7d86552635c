"""Sharding: declared layouts, Grok-1's golden layout, equivalence on any mesh, multi-process runs,
and the memory plan."""

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from backends.cpu import ops as panel
from backends.cpu.layout import ExpertWeights
from backends import XLA
from model import GROK_1, TINY, forward, init_params, new_memory
from model.plan import abstract_params, memory_plan
from model.sharding import (DEFAULT_RULES, EXPERT_PARALLEL_RULES, logical_axes, make_mesh, memory_specs, param_specs,
                            path_str)
from runner import Executor, InferenceRunner, ModelRunner, Request
from tests.helpers import REPO, lively
from tests.test_quant import quantize_params

# every sharded dimension divisible by 8: emb 64, 8 KV heads, ffn 88, 4 experts
SHARD = dataclasses.replace(TINY, vocab_size=512, emb_size=64, num_q_heads=8, num_kv_heads=8, key_size=8,
                            sequence_len=48)
# The meshes run with -m slow: each compiles a runner's every variant, after a single-device
# runner's (90 s on 2 cores for one mesh). In the default run a (2, 4) runner serves in
# test_server's two-process test (its greedy answers checked against full forwards on one device,
# its sampled one against the same request alone), and the scale-group test below and
# test_checkpoints' restores run the forward on sharded meshes against one device.
MESHES = [pytest.param(shape, marks=pytest.mark.slow) for shape in [(1, 1), (2, 4), (1, 8), (4, 2), (8, 1)]]
PROMPTS = [[5, 9, 200, 17, 3, 44], [77] * 11, list(range(30, 50)), [400, 401]]
# a round of at most 16 tokens: prefill calls of 8 or 16 packed tokens (few variants to compile
# on each mesh; several prompts still share calls, and the 20-token one is chunked)
BUDGET = 16


@pytest.fixture(scope="module")
def shard_params():
    return lively(init_params(SHARD, jax.random.PRNGKey(3)))


def flat_specs(tree):
    return {path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, P))[0]}


# ---- declared layouts ------------------------------------------------------------------------
def test_golden_grok1_layout_on_a_1x8_mesh():
    """docs/grok1.md §6's partition table, leaf by leaf, for the released int8 checkpoint's shapes."""
    mesh = jax.sharding.AbstractMesh((1, 8), ("data", "model"))
    specs = flat_specs(param_specs(abstract_params(GROK_1, quantized=True), mesh=mesh))
    grok1 = {
        "language_model/in_out_embed/embeddings": P(None, ("data", "model")),
        "language_model/rms_norm/scale": P(None),
        "multi_head_attention/query/w": P("data", "model"),
        "multi_head_attention/key/w": P("data", "model"),
        "multi_head_attention/value/w": P("data", "model"),
        "multi_head_attention/linear/w": P("model", "data"),
        "router/w": P("data", None),
        "moe/linear/w": P(None, "data", "model"),
        "moe/linear_v/w": P(None, "data", "model"),
        "moe/linear_1/w": P(None, "model", "data"),
        "rms_norm/scale": P(None), "rms_norm_1/scale": P(None),
        "rms_norm_2/scale": P(None), "rms_norm_3/scale": P(None),
    }
    assert len(specs) == 2 + 12 + 7  # 7 of 12 layer leaves are int8: weight + scales; the layers stacked
    for name, spec in specs.items():
        base = name.removesuffix("/weight").removesuffix("/scales")
        key = next(k for k in grok1 if base == k or base.endswith("/" + k))
        # Grok-1 gives a weight's scales the weight's own spec; the scale groups (1 or 8) divide
        # the model axis here, so ours are the same on this mesh. Each layer's is Grok-1's; the
        # stack's leading axis (the scan's) is never sharded.
        layer = name.startswith("transformer/layers/")
        assert tuple(spec) == ((None,) if layer else ()) + tuple(grok1[key]), name
    # Deliberate difference: Grok-1 shards the KV memory's *sequence* over "model" and reshards
    # it to heads in every layer of every step; ours keeps KV heads over "model" throughout, and
    # holds them [B, K, S, H] (heads before positions) so attention reads them without a transpose.
    kv = memory_specs(jax.eval_shape(lambda: new_memory(SHARD, 8)))
    assert kv.k == P(None, "data", "model", None, None) and kv.step == P("data")  # [L, B, K, S, H]


def test_each_weight_is_declared_once_and_everything_derives_from_it():
    """The layers declare shape, axes and init together; the parameters, the abstract shapes, the
    checkpoint checks and the shardings all read that one declaration."""
    from checkpoints.materialize import declared_shapes
    from model.plan import abstract_params
    from model.transformer import declared_params

    declared = declared_params(GROK_1)
    assert len(declared) == 2 + 12  # embedding and final norm; the layers' 4 norms, 4 attention, router, 3 experts
    shapes = {path_str(p): tuple(leaf.shape)
              for p, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(GROK_1))[0]}
    assert shapes == {path: shape for path, (shape, _) in declared.items()} == declared_shapes(GROK_1)
    for path, (shape, axes) in declared.items():
        assert logical_axes(path) == axes and len(axes) == len(shape), path
    assert declared["transformer/layers/moe/linear_1/w"] == ((64, 8, 32768, 6144), ("layers", "experts", "mlp", "embed"))


def test_a_leaf_without_a_rule_is_an_error():
    with pytest.raises(ValueError, match="'transformer/layers/moe/bias' is declared by no layer"):
        logical_axes("transformer/layers/moe/bias")
    with pytest.raises(ValueError, match="no entry for logical axes"):
        param_specs({"language_model": {"rms_norm": {"scale": jnp.zeros(4)}}}, rules={})


def test_an_undivided_dimension_names_both():
    params = jax.eval_shape(lambda: init_params(TINY, jax.random.PRNGKey(0)))
    with pytest.raises(ValueError, match=r"in_out_embed/embeddings: dimension 1 of size 32 is not divisible "
                                         r"by mesh axis \('data', 'model'\) of size 3"):
        param_specs(params, mesh=jax.sharding.AbstractMesh((1, 3), ("data", "model")))
    memory = jax.eval_shape(lambda: new_memory(TINY, 8))  # 2 KV heads cannot split 8 ways
    with pytest.raises(ValueError, match=r"KVMemory.k: dimension 2 of size 2 is not divisible by mesh axis "
                                         r"'model' of size 8"):
        memory_specs(memory, mesh=jax.sharding.AbstractMesh((1, 8), ("data", "model")))


# ---- equivalence on 8 fake CPU devices ----------------------------------------------------------
@pytest.fixture(scope="module")
def plain_params():
    """Unscaled random parameters for logit comparisons (``lively`` ones amplify rounding 30x)."""
    return init_params(SHARD, jax.random.PRNGKey(4))


@pytest.fixture(scope="module")
def single_device_logits(plain_params):
    tokens = np.array([p + [0] * (20 - len(p)) for p in PROMPTS], np.int32)
    lengths = np.array([len(p) for p in PROMPTS])
    return tokens, lengths, np.asarray(forward(plain_params, tokens, SHARD, lengths=lengths, backend=XLA()).logits)


@pytest.fixture(scope="module")
def single_device(shard_params, single_device_logits):
    """The logits, and the tokens a single-device runner serves (a runner's every variant compiled)."""
    runner = InferenceRunner(runner=ModelRunner(model=SHARD, params=shard_params), batch_size=8, pad_sizes=(8, 16),
                             max_num_batched_tokens=BUDGET)
    runner = runner.initialize()
    return (*single_device_logits, generate(runner))


def assert_close_fp32(got, want):
    """Within 1e-5, relative to the logit's size where it exceeds 1: sharded contractions sum in
    another order, and a logit of 31 has an fp32 spacing of 2e-6 (tied embeddings make the token's
    own logit large)."""
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def generate(runner):
    requests = [Request(p, temperature=0.0, max_len=12) for p in PROMPTS]
    requests += [Request(p, temperature=1.0, rng_seed=i, max_len=8) for i, p in enumerate(PROMPTS)]
    return [c.token_ids for c in runner.generate(requests)]


@pytest.mark.parametrize("shape", MESHES)
def test_meshes_match_single_device(shard_params, plain_params, single_device, shape):
    tokens, lengths, want_logits, want_tokens = single_device
    mesh = make_mesh(shape, jax.devices()[: shape[0] * shape[1]])
    plain = ModelRunner(model=SHARD, params=plain_params)
    plain = Executor.create(plain, mesh, batch_size=8)
    logits = plain.forward(plain.params, tokens, lengths)
    assert_close_fp32(np.asarray(logits), want_logits)
    runner = InferenceRunner(runner=ModelRunner(model=SHARD, params=shard_params), batch_size=8,
                             pad_sizes=(8, 16), mesh=mesh, max_num_batched_tokens=BUDGET)
    runner = runner.initialize(warmup=False)  # the variants it serves, as it calls them (single_device compiles all)
    engine = runner.engine.executor
    assert generate(runner) == want_tokens
    # outputs carry the declared shardings: on a mesh the canonical stacked weights with their
    # specs; on one CPU device the CPU backend's layout (split per expert, or in panels where the
    # runner measured the kernel faster)
    backend = engine.selection.backend
    if backend.name == "xla":  # always on a mesh; on one device where asked (GROK_RUNNER_BACKEND=xla)
        w = engine.params["transformer"]["layers"]["moe"]["linear"]["w"]  # every layer's, stacked and scanned
        assert w.sharding.spec == P(None, None, "data", "model") and w.sharding.mesh.shape == mesh.shape
    else:  # the CPU backend runs the layers unrolled, each over its own buffers
        w = engine.params["transformer"]["decoder_layer_1"]["moe"]["linear"]["w"]
        if "moe" in backend.on:
            assert isinstance(w, panel.PanelWeight) and w.shape[0] == SHARD.num_experts
        else:
            assert isinstance(w, ExpertWeights) and len(w.experts) == SHARD.num_experts
    assert backend.name == "xla" or mesh.size == 1
    state = runner.state
    assert state.memory.k.sharding.spec == P(None, "data", "model", None, None)
    assert state.memory.step.sharding.spec == P("data") and state.tokens.sharding.spec == P("data")


def test_expert_parallelism_matches(plain_params, single_device_logits):
    """Experts over ``model``: the weights sharded so, the logits the single device's (the served
    tokens: the slow test below)."""
    tokens, lengths, want_logits = single_device_logits
    plain = ModelRunner(model=SHARD, params=plain_params, rules=EXPERT_PARALLEL_RULES)
    plain = Executor.create(plain, make_mesh((2, 4)), batch_size=8)
    w = plain.params["transformer"]["layers"]["moe"]["linear_1"]["w"]
    assert w.sharding.spec == P(None, "model", None, "data")
    assert_close_fp32(np.asarray(plain.forward(plain.params, tokens, lengths)), want_logits)


@pytest.mark.slow  # in the default run test_server's two-process test serves on a (2, 4) mesh
def test_expert_parallel_serving_matches(shard_params, single_device):
    want_tokens = single_device[3]
    mesh = make_mesh((2, 4))
    runner = InferenceRunner(runner=ModelRunner(model=SHARD, params=shard_params, rules=EXPERT_PARALLEL_RULES),
                             batch_size=8, pad_sizes=(8, 16), mesh=mesh, max_num_batched_tokens=BUDGET)
    runner = runner.initialize()
    engine = runner.engine.executor
    w = engine.params["transformer"]["layers"]["moe"]["linear_1"]["w"]
    assert w.sharding.spec == P(None, "model", None, "data")
    assert generate(runner) == want_tokens


# groups sharded where the model axis divides them (2 on 2, 8 on 8) and replicated where it does
# not (2 on 4); all 12 pairs with -m slow
SCALE_GROUP_CASES = [(2, (1, 2)), (2, (1, 4)), (8, (1, 8))]
SCALE_GROUP_CASES += [pytest.param(g, shape, marks=pytest.mark.slow) for g in (1, 2, 8)
                      for shape in [(1, 2), (1, 4), (2, 4), (1, 8)] if (g, shape) not in SCALE_GROUP_CASES]


@pytest.mark.parametrize("groups,shape", SCALE_GROUP_CASES)
def test_scale_groups_work_on_any_model_axis(plain_params, groups, shape):
    qparams = quantize_params(plain_params, groups=groups)
    tokens = np.array([PROMPTS[2]], np.int32)
    want = np.asarray(forward(qparams, tokens, SHARD, backend=XLA()).logits)
    mesh = make_mesh(shape, jax.devices()[: shape[0] * shape[1]])
    engine = ModelRunner(model=SHARD, params=qparams, backend="xla")  # stacked, as stored
    engine = Executor.create(engine, mesh, batch_size=8)
    down = engine.params["transformer"]["layers"]["moe"]["linear_1"]["w"]
    expected_g = "model" if groups % shape[1] == 0 else None  # G sharded where the mesh divides it
    assert down.scales.sharding.spec[2] == expected_g
    got = np.asarray(engine.forward(engine.params, tokens, np.array([tokens.shape[1]])))
    assert_close_fp32(got, want)


def test_kv_memory_is_never_resharded_inside_a_step(shard_params):
    engine = ModelRunner(model=SHARD, params=shard_params)
    engine = Executor.create(engine, make_mesh((2, 4)), batch_size=8)
    step = engine._decode.variant(kv_len=SHARD.sequence_len, steps=2)
    hlo = step.lower(engine.params, engine.new_state(), engine.no_mask, np.int32(2)).compile().as_text()
    collectives = [line for line in hlo.splitlines()
                   if re.search(r"\b(all-to-all|all-gather|collective-permute|all-reduce|reduce-scatter)(-start)?\(", line)]
    assert collectives  # the weights' d_model over "data" does need all-gathers
    s = SHARD.sequence_len
    for line in collectives:
        result = re.search(r"= \(?\w+\[([0-9,]*)\]", line)
        dims = [int(d) for d in result.group(1).split(",") if d] if result else []
        # a layer's [B, K, S, H], or the stack's [L, B, K, S, H]
        assert not (len(dims) in (4, 5) and s in dims), f"the KV memory moves between devices: {line.strip()[:160]}"


# ---- multi-process ----------------------------------------------------------------------------
MULTIHOST = dataclasses.replace(TINY, vocab_size=512, emb_size=64, num_q_heads=4, num_kv_heads=4, key_size=8)


def multihost_case():
    """Runs identically in one process (8 devices) and in each of 2 processes (4 devices each)."""
    params = jax.tree_util.tree_map(np.asarray, lively(init_params(MULTIHOST, jax.random.PRNGKey(5))))
    runner = InferenceRunner(runner=ModelRunner(model=MULTIHOST, params=params), batch_size=4,
                             pad_sizes=(8, 16), mesh=make_mesh((2, 4)), max_num_batched_tokens=BUDGET)
    runner = runner.initialize(warmup=False)  # the variants it serves, as it calls them
    requests = [Request(p, temperature=0.0, max_len=10) for p in PROMPTS[:3]]
    requests.append(Request(PROMPTS[3], temperature=1.0, rng_seed=11, max_len=10))
    return [c.token_ids for c in runner.generate(requests)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # test_server's two-process server checks the same tokens against one process, and more
def test_two_processes_give_the_same_tokens_as_one(tmp_path):
    want = multihost_case()
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    worker = str(REPO / "tests" / "multihost_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(i), "2", port, str(tmp_path / f"out{i}.json")],
                              env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    for i in range(2):
        result = json.loads((tmp_path / f"out{i}.json").read_text())
        assert result["process"] == i and result["devices"] == 8
        assert result["tokens"] == want


# ---- memory plan ------------------------------------------------------------------------------
def test_plan_matches_real_array_sizes(shard_params):
    qparams = quantize_params(shard_params, groups=2)
    mesh = make_mesh((2, 4))
    engine = ModelRunner(model=SHARD, params=qparams)
    engine = Executor.create(engine, mesh, batch_size=8)
    plan = memory_plan(SHARD, jax.eval_shape(lambda: qparams), mesh_shape=(2, 4), batch_size=8)
    device = mesh.devices.flat[0]
    real = {}
    for leaf in jax.tree_util.tree_leaves(engine.params):
        shard = next(s for s in leaf.addressable_shards if s.device == device)
        real[leaf.dtype.name] = real.get(leaf.dtype.name, 0) + shard.data.nbytes
    assert plan.weight_bytes_by_dtype == real
    state = engine.new_state()
    kv_real = sum(next(s for s in x.addressable_shards if s.device == device).data.nbytes
                  for x in (state.memory.k, state.memory.v))
    assert plan.kv_bytes == kv_real
    assert plan.kv_bytes_per_slot == kv_real // (8 // 2)


def test_plan_reproduces_grok1_figures():
    one = memory_plan(GROK_1, abstract_params(GROK_1, quantized=True), mesh_shape=(1, 1))
    assert abs(one.total_weight_bytes / 1e9 - 318) < 1.0  # about 318 GB of int8 checkpoint
    assert one.kv_bytes_per_slot == 2 * 2**30  # 2 GiB of bf16 KV per 8192-token sequence
    eight = memory_plan(GROK_1, abstract_params(GROK_1, quantized=True), mesh_shape=(1, 8), batch_size=8,
                        device_memory=141 * 2**30)
    assert eight.kv_bytes_per_slot == 2 * 2**30 // 8
    assert abs(eight.weight_bytes - one.weight_bytes / 8) / eight.weight_bytes < 0.01
    free = 141 * 2**30 - eight.weight_bytes
    assert eight.max_batch(8192) == free // (2 * 2**30 // 8)


def test_run_py_plan(capsys):
    sys.path.insert(0, str(REPO))
    import run

    assert run.main(["--plan", "--preset", "grok-1", "--mesh", "1,8", "--batch-size", "8",
                     "--device-memory", "141"]) == 0
    out = capsys.readouterr().out
    assert "318.2 GB" in out and "KV per slot    : 256.00 MiB at 8192 tokens" in out
    assert "context   8,192: batch" in out


def test_the_plan_counts_the_steps_a_server_compiles(tiny_params, capsys):
    """``grok-runner plan`` names the steps a server with the same settings compiles at start:
    the same list the engine warms, from the same scheduler."""
    from runner import compiled

    settings = dict(pad_sizes=(8, 16, 32), max_num_batched_tokens=32, speculative=2, score_prompts=True)
    runner = InferenceRunner(runner=ModelRunner(model=TINY, params=tiny_params, backend="xla"), batch_size=4,
                             **settings).initialize(warmup=False)
    planned = compiled.steps(TINY, 4, **settings)
    assert (planned.prefills, planned.decodes) == runner.engine.variants(True)
    assert planned.count == len(runner.engine.executor.variants(planned.prefills, planned.decodes))
    assert run_plan(["--preset", "tiny", "--batch-size", "4", "--pad-sizes", "8,16,32", "--max-num-batched-tokens",
                     "32", "--speculative", "2"]) == 0
    assert f"a server of batch 4 compiles {planned.count} steps: {len(planned.prefills)} prefill" in capsys.readouterr().out


def test_an_abstract_executor_lowers_the_steps_a_server_compiles(tiny_params):
    """From shapes alone (what the plan's compile estimate compiles, on Grok-1 too): every step
    lowers to the program of a server holding the weights, on a 4 x 2 mesh."""
    mesh = make_mesh((4, 2))
    real = InferenceRunner(runner=ModelRunner(model=TINY, params=tiny_params, backend="xla"), mesh=mesh, batch_size=4,
                           pad_sizes=(8, 16), max_num_batched_tokens=16).initialize(warmup=False).engine.executor
    abstract = Executor.abstract(TINY, abstract_params(TINY), mesh, 4)
    assert isinstance(jax.tree_util.tree_leaves(abstract.params)[0], jax.ShapeDtypeStruct)
    for (key, _, lower), (_, _, lower_real) in zip(abstract.variants([(4, 16, False)], [(64, 2, 0)]),
                                                   real.variants([(4, 16, False)], [(64, 2, 0)])):
        assert lower().as_text() == lower_real().as_text(), key


def run_plan(argv):
    from cli.main import main

    return main(["plan", *argv])
