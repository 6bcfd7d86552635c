"""Test setup: 8 fake CPU devices, the CPU platform, before anything imports JAX; a compilation cache."""

import os

from tests import COMPILE_FAST  # noqa: E402 (no JAX import)

os.environ["XLA_FLAGS"] = " ".join((os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
                                    COMPILE_FAST)).strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# One persistent compilation cache for the session, shared by its pytest-xdist workers (one run id):
# runners of the same config and shapes (many fixtures build one, in either worker) compile each
# variant once (a runner's warm-up: 22 s cold, 4 s cached). A size limit turns on the cache's file
# lock, so one worker never reads an entry the other is still writing. Only programs that took
# 0.1 s or more to compile are written: with that lock, every write lists and reads the whole
# directory to decide what to evict (jax 0.10.2's LRUCache), 125 ms at the 3,050 entries a run
# wrote when every program was kept (the suite's small checks compile thousands of 20 ms
# programs, cheaper to compile again than to store); at 0.1 s a run writes about 300, and the
# default run took 7 min 46 s instead of 9 min 12 s (2-core Xeon, 2026-12-05, 992 -> 825 s serial).
_run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
_cache = os.path.join(tempfile.gettempdir(), f"grok-runner-tests-xla-{_run}") if _run else tempfile.mkdtemp(
    prefix="grok-runner-tests-xla-")
jax.config.update("jax_compilation_cache_dir", _cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
jax.config.update("jax_compilation_cache_max_size", 8 << 30)
# One store of compiled steps for the session (runner/executables.py), beside it and shared the
# same way: every runner's default (InferenceRunner.compile_cache) and every command's the tests
# start (they inherit the variable). A runner whose config, shapes and placement a test in either
# worker already served loads those steps instead of tracing, lowering and compiling them again.
os.environ["GROK_RUNNER_COMPILE_CACHE"] = _cache + "-steps"
# The kernels built for another CPU than this one (-march=x86-64-v3, the AVX2 variant), by the
# tests that check that build: one library a session, the second test loading the first's.
OTHER_MARCH_KERNELS = _cache + "-kernels"

from tests.helpers import REFERENCE  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a test taking more than a few seconds")


# The files that take longest, first (serial seconds of the default run on a 2-core Xeon with
# AVX-512, 2026-12-05): pytest-xdist hands whole files to its workers in collection order, and a
# long file started last keeps one worker busy while the other idles. The rest keep their order.
LONGEST_FIRST = ("test_bf16.py", "test_server.py", "test_model.py", "test_tools.py",  # 72, 67, 59, 50
                 "test_http.py", "test_kv_int8.py", "test_command.py", "test_runner.py",  # 46, 43, 42, 42
                 "test_runner_reference.py", "test_reference_parity.py", "test_sharding.py",  # 41, 36, 29
                 "test_default_model.py", "test_grok2.py", "test_malformed.py", "test_speculative.py",  # 29, 28, 28, 28
                 "test_cpu_backend.py", "test_checkpoints.py", "test_core.py", "test_prefix_cache.py")  # 27, 23, 21, 21


# The suite's shape, guarded without a clock (docs/testing.md): how many of the runner's steps
# (prefill and decode variants, about 1-2 s of compiling each) each file may compile, session
# fixtures it builds first included; a step loaded from the session's store is not compiled. Set
# on 2026-12-05 from the counts of a default run (docs/testing.md) with headroom. A file over its
# budget fails at its end, naming the count: compile fewer shapes (a runner without the warm-up
# compiles what its tests call), share a runner or a server, or raise its line here saying why.
STEP_BUDGET = {"test_runner.py": 40, "test_server.py": 24, "test_default_model.py": 24, "test_grok2_serving.py": 24,
               "test_core.py": 20, "test_bf16.py": 20}  # 23, 17, 13, 13, 10, 10 measured (the shipped runner's 6 included)
DEFAULT_STEP_BUDGET = 16  # every other file (at most 7 measured)


@pytest.fixture(scope="module", autouse=True)
def step_budget(request):
    """Counts the module's compiled steps; over its ``STEP_BUDGET`` the module fails at its end.
    Only in the default run (``-m slow`` compiles the heaviest cases on purpose)."""
    from runner.compile_count import steps_compiled

    before = steps_compiled()
    yield
    if request.config.getoption("markexpr") != "not slow":
        return
    used, budget = steps_compiled() - before, STEP_BUDGET.get(request.path.name, DEFAULT_STEP_BUDGET)
    assert used <= budget, (f"{request.path.name} compiled {used} of the runner's steps, over its budget of "
                            f"{budget} (tests/conftest.py's STEP_BUDGET): compile fewer shapes or share a runner")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: within a file, as written


@pytest.fixture(scope="session")
def other_march_kernels():
    """The kernels' cache for builds with ``GROK_RUNNER_KERNEL_MARCH`` (each march keyed apart)."""
    return OTHER_MARCH_KERNELS


@pytest.fixture(scope="session")
def tiny_params():
    from model import TINY, init_params

    return init_params(TINY, jax.random.PRNGKey(0))


@pytest.fixture(scope="session")
def reference_dir():
    if not (REFERENCE / "ckpt" / "ckpt-0").is_dir():
        pytest.skip(f"Grok-1 reference fixture not found at {REFERENCE}")
    return REFERENCE


@pytest.fixture(scope="session")
def test_tokenizer(tmp_path_factory):
    """A 320-piece BPE SentencePiece model with byte fallback and Grok-1's special ids."""
    import sentencepiece as spm

    directory = tmp_path_factory.mktemp("tokenizer")
    words = ("the of and to a in that it was her she he not be as you had with for his my but "
             "on all at by this have which so from they were would no when are an been could "
             "mister elizabeth darcy bennet sister ball house letter").split()
    lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(400)]
    (directory / "corpus.txt").write_text("\n".join(lines))
    spm.SentencePieceTrainer.train(
        input=str(directory / "corpus.txt"), model_prefix=str(directory / "sp"), vocab_size=320,
        model_type="bpe", byte_fallback=True, pad_id=0, bos_id=1, eos_id=2, unk_id=3,
        character_coverage=1.0, minloglevel=2)
    return str(directory / "sp.model")


@pytest.fixture(scope="session")
def shipped_runner():
    """The shipped default model (checkpoints/austen-moe) as ``run.py`` loads it for one prompt
    (one slot, the default buckets, one CPU device, the backend it chooses): shared by the tests
    that generate from it, and its compiled variants are ``run.py``'s own."""
    from runner import InferenceRunner, ModelRunner
    from runner.runner import default_checkpoint

    checkpoint = default_checkpoint()
    if checkpoint is None:
        pytest.fail("the shipped model checkpoints/austen-moe is missing")
    runner = InferenceRunner(runner=ModelRunner(checkpoint_path=checkpoint))
    return runner.initialize(warmup=False)  # each variant compiled (or loaded) as a test first calls it
