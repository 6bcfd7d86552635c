"""Test setup: 8 fake CPU devices, the CPU platform, before anything imports JAX."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import pathlib  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
REFERENCE = SHARED_DATA / "grok1_reference"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a test taking more than a few seconds")


@pytest.fixture(scope="session")
def tiny_params():
    from model import TINY, init_params

    return init_params(TINY, jax.random.PRNGKey(0))


@pytest.fixture(scope="session")
def reference_dir():
    if not (REFERENCE / "ckpt" / "ckpt-0").is_dir():
        pytest.skip(f"Grok-1 reference fixture not found at {REFERENCE}")
    return REFERENCE
