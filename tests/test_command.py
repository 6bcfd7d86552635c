"""The ``grok-runner`` command as a user meets it: installed from a wheel into a fresh venv and run
from a directory outside the checkout; every check that needs no weights (the tokenizer, the
config, the mesh, the memory plan) failing in seconds, one line saying what to pass, before the
restore."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import jax
import pytest

from tests import COMPILE_FAST
from tests.helpers import REFERENCE, REPO

# one CPU device, as a user's laptop (compiling fast, as every process of the tests: tests/__init__.py)
CPU_ENV = dict(os.environ, XLA_FLAGS=COMPILE_FAST, JAX_PLATFORMS="cpu")


def command(*args, cwd=REPO, timeout=300, env=CPU_ENV):
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


# ---- the wheel ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The project built into a wheel and installed (not editable) in a fresh venv that sees the
    packages this Python runs the tests with for its dependencies (nothing is downloaded); its
    ``bin/``."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # a copy: setuptools writes build/ and *.egg-info into the tree it builds
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                                                "bench", "train", ".pytest_cache"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(root / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (root / "dist").glob("*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    # The dependencies are the ones the tests run with: the site-packages directories on this
    # interpreter's path, a virtual environment's included (``--system-site-packages`` would give
    # the base interpreter's, where a venv's packages are missing). Plain paths: their .pth files
    # are not run, so an editable install of this checkout does not shadow the wheel.
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    outer = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]
    (Path(purelib) / "_tests_dependencies.pth").write_text("".join(p + "\n" for p in outer))
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "-q",
                           "--disable-pip-version-check", str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return wheel, venv / "bin"


def test_the_wheel_carries_the_command_the_kernels_sources_and_the_shipped_model(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("cli/__init__.py", "cli/serve.py", "cli/generate.py",
                 "checkpoints/austen-moe/config.json", "checkpoints/austen-moe/tokenizer.model",
                 "checkpoints/austen-moe/model-00001-of-00001.safetensors",
                 "checkpoints/austen-moe/model.safetensors.index.json", "backends/cpu/panel_matmul.cc",
                 "server/static/chat.html"):
        assert name in names, name
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "grok-runner = cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_installed_command_runs_the_shipped_model_from_outside_the_checkout(installed, tmp_path):
    _, bin_dir = installed
    where = subprocess.run([str(bin_dir / "python"), "-c", "import cli, runner.runner as r; "
                            "print(cli.__file__); print(r.default_checkpoint())"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    module, checkpoint = where.stdout.split()
    assert module.startswith(str(bin_dir.parent)) and checkpoint.startswith(str(bin_dir.parent)), where.stdout
    for sub in ("serve", "convert", "plan", "generate"):
        helped = subprocess.run([str(bin_dir / "grok-runner"), sub, "--help"], cwd=tmp_path, env=CPU_ENV,
                                capture_output=True, text=True, timeout=120)
        assert helped.returncode == 0 and f"grok-runner {sub}" in helped.stdout, helped.stderr[-800:]
    plan = subprocess.run([str(bin_dir / "grok-runner"), "plan", "--preset", "grok-1", "--mesh", "1,8",
                           "--device-memory", "141"], cwd=tmp_path, env=CPU_ENV, capture_output=True, text=True,
                          timeout=120)
    assert plan.returncode == 0 and "315.68B parameters" in plan.stdout, plan.stdout + plan.stderr[-800:]
    # its compiled steps in the session's store ($GROK_RUNNER_COMPILE_CACHE): keyed by the installed
    # sources, so they are the checkout's own only where the wheel holds the same code
    run = subprocess.run([str(bin_dir / "grok-runner"), "--prompt", "It is a truth", "--max-tokens", "4",
                          "--temperature", "0"],
                         cwd=tmp_path, env=CPU_ENV, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("It is a truth") and len(run.stdout.split()) > 4, run.stdout
    assert "time to first token" in run.stderr


# ---- Grok-1 from the weights people download ----------------------------------------------------
@pytest.fixture
def downloaded(reference_dir, tmp_path):
    """An original-layout checkpoint as people download Grok-1's: ``ckpt-0/`` and no tokenizer."""
    weights = tmp_path / "grok-1" / "checkpoints"
    weights.mkdir(parents=True)
    (weights / "ckpt-0").symlink_to(reference_dir / "ckpt" / "ckpt-0")
    return weights


@pytest.mark.parametrize("sub", ["generate", "serve"])
def test_original_weights_without_a_tokenizer_fail_in_one_line_saying_what_to_pass(downloaded, sub):
    done = command(sub, "--checkpoint", str(downloaded), "--config", "grok-1-reference-tiny", "--port", "1") \
        if sub == "serve" else command("--checkpoint", str(downloaded), "--config", "grok-1-reference-tiny")
    assert done.returncode == 2, done.stderr[-800:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "no tokenizer.model in it or its parent directory" in last
    assert "pass --tokenizer PATH" in last and "github.com/xai-org/grok-1" in last
    assert "restore" not in done.stderr and "Traceback" not in done.stderr and "starting on" not in done.stderr


def test_original_weights_without_a_config_say_to_pass_one(downloaded):
    done = command("--checkpoint", str(downloaded))
    assert done.returncode == 2 and "pass --config grok-1" in done.stderr.strip().splitlines()[-1], done.stderr


def test_the_tokenizer_is_looked_for_beside_ckpt_0_and_one_level_up_and_checked_there(downloaded):
    from checkpoints import CheckpointError
    from checkpoints.restore import find_tokenizer, inspect

    assert find_tokenizer(str(downloaded)) is None
    grok = REFERENCE.parent / "grok1-tokenizer.model"  # 131,072 pieces; the tiny config has 12,288
    if not grok.is_file():
        pytest.skip(f"{grok} not found")
    (downloaded.parent / "tokenizer.model").symlink_to(grok)  # where xai-org/grok-1's repository keeps it
    assert find_tokenizer(str(downloaded)) == str(downloaded.parent / "tokenizer.model")
    (downloaded / "tokenizer.model").symlink_to(grok)  # beside ckpt-0/ wins
    assert find_tokenizer(str(downloaded)) == str(downloaded / "tokenizer.model")
    with pytest.raises(CheckpointError, match="tokenizer vocabulary has 131072 pieces but the config's "
                                              "vocab_size is 12288"):
        inspect(str(downloaded), "grok-1-reference-tiny", need_tokenizer=True)
    done = command("--checkpoint", str(downloaded), "--config", "grok-1-reference-tiny")
    assert done.returncode == 2 and "vocab_size is 12288" in done.stderr and "restore" not in done.stderr


def test_weights_and_kv_larger_than_a_device_fail_before_the_restore(reference_dir, monkeypatch):
    """On a device that reports its memory (GPUs, TPUs), a plan that cannot fit is refused before
    a byte of the weights is read."""
    import importlib

    import runner.runner as runner_module
    from runner import InferenceRunner, ModelRunner

    def no_restore(*args, **kwargs):
        raise AssertionError("the restore ran")

    monkeypatch.setattr(importlib.import_module("checkpoints.restore"), "materialize", no_restore)
    monkeypatch.setattr(runner_module, "device_memory", lambda device: 2**20)  # 1 MiB
    spec = InferenceRunner(runner=ModelRunner(checkpoint_path=str(reference_dir / "ckpt"),
                                              model="grok-1-reference-tiny"), batch_size=2)
    with pytest.raises(ValueError, match=r"do not fit in its 0.0 GiB: use more devices on the mesh's model "
                                         r"axis \(--mesh\), a smaller --batch-size or --kv-dtype int8"):
        spec.initialize(warmup=False)


def test_a_cpu_run_is_planned_against_the_hosts_memory_before_the_restore(reference_dir, monkeypatch):
    """CPU devices report no memory: a CPU run is planned against the host's (its share for each of
    the process's CPU devices), so a config whose KV cannot fit (10^9 positions asked 59.6 GiB of
    the calibration before) is refused before anything is read or allocated."""
    import importlib

    import runner.runner as runner_module
    from runner import InferenceRunner, ModelRunner

    assert 2**28 < runner_module.host_memory() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def no_restore(*args, **kwargs):
        raise AssertionError("the restore ran")

    monkeypatch.setattr(importlib.import_module("checkpoints.restore"), "materialize", no_restore)
    monkeypatch.setattr(runner_module, "host_memory", lambda: 2**20 * len(jax.local_devices(backend="cpu")))
    spec = InferenceRunner(runner=ModelRunner(checkpoint_path=str(reference_dir / "ckpt"),
                                              model="grok-1-reference-tiny"), batch_size=2)
    with pytest.raises(ValueError, match=r"do not fit in its 0.0 GiB"):
        spec.initialize(warmup=False)


def test_every_subcommand_shares_the_model_flags_and_checks_them_before_loading():
    for sub in ("serve", "generate", "compile"):
        done = command(sub, "--mesh", "1,0")
        assert done.returncode == 2 and "argument --mesh: expected DATA,MODEL" in done.stderr, done.stderr
        assert "restore" not in done.stderr
    done = command("plan", "--preset", "no-such")
    assert done.returncode == 2 and "--preset" in done.stderr.strip().splitlines()[-1]
    done = command("serve", "--allowed-origins", "example.com")
    assert done.returncode == 2 and "argument --allowed-origins" in done.stderr


def test_compile_fills_serves_store_from_the_headers_and_says_what_it_needs(tmp_path):
    """``grok-runner compile`` takes serve's flags and compiles its steps into --compile-cache (the
    runner's ``compile_ahead``, tested against a start in tests/test_runner.py); on one CPU device
    it asks for --backend xla, and it needs a store."""
    flags = ("--batch-size", "1", "--pad-sizes", "16", "--max-num-batched-tokens", "16", "--prefix-cache-gb", "0",
             "--compile-cache", str(tmp_path))
    done = command("compile", *flags, "--backend", "xla")
    assert done.returncode == 0, done.stderr
    compiled = len(list(tmp_path.rglob("*.exe")))
    assert compiled > 2 and f"{compiled} steps compiled into {tmp_path} (0 were stored already)" in done.stdout
    done = command("compile", *flags)
    assert done.returncode == 2 and "takes the XLA backend (backend='xla')" in done.stderr, done.stderr
    done = command("compile", "--compile-cache", "off")
    assert done.returncode == 2 and "nowhere to compile into" in done.stderr, done.stderr


def test_a_stored_compiled_step_is_loaded_only_from_files_this_user_alone_may_write(tmp_path):
    """A compiled step is unpickled: a file or directory others may write is refused, and compiled again."""
    import jax
    import jax.numpy as jnp

    from runner.executables import ExecutableStore

    store = ExecutableStore(tmp_path, "key")
    store.save("double", jax.jit(lambda x: 2 * x).lower(jnp.ones(3)).compile())
    assert store.load("double") is not None
    (file,) = store.path.glob("*.exe")
    file.chmod(0o666)
    assert store.load("double") is None
    file.chmod(0o600)
    store.path.chmod(0o777)
    assert store.load("double") is None
    store.path.chmod(0o700)
    assert store.load("double") is not None


@pytest.mark.parametrize("source, said", [("{% if true %}" * 5000 + "x" + "{% endif %}" * 5000, "too deeply nested"),
                                          ("{% for %}", "not a valid Jinja2 template")])
def test_a_chat_template_that_does_not_compile_stops_serve_in_one_line_naming_it(tmp_path, source, said):
    """The template is compiled before anything else starts (5,000 nested ifs raised a
    RecursionError out of the server before): one line naming the file, exit 2."""
    template = tmp_path / "hostile.jinja"
    template.write_text(source)
    done = command("serve", "--chat-template", str(template), "--port", "1")
    assert done.returncode == 2, done.stderr[-800:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {template}: ") and said in last and "Traceback" not in done.stderr
