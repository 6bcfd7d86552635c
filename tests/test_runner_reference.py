"""The runner on the Grok-1 reference fixture reproduces the reference runner's tokens."""

import json

import numpy as np
import pytest

from runner import InferenceRunner, ModelRunner, Request


@pytest.fixture(scope="module")
def fixture_runner(reference_dir):
    runner = InferenceRunner(
        runner=ModelRunner(checkpoint_path=str(reference_dir / "ckpt"), model=_fixture_config(), dtype="float32"),
        pad_sizes=(16, 64), batch_size=1)
    runner = runner.initialize(warmup=False)  # tokens are what these tests check: only the variants they use compile
    return runner


def _fixture_config():
    from model import GROK_1_REFERENCE_TINY

    return GROK_1_REFERENCE_TINY


def test_greedy_decode_reproduces_reference(reference_dir, fixture_runner):
    want = np.load(reference_dir / "decode_tokens.npy").tolist()
    prompt = json.loads((reference_dir / "results.json").read_text())["greedy_decode"]["prompt_ids"]
    done = fixture_runner.generate([prompt], temperature=0.0, max_len=len(want))[0]
    assert done.token_ids == want


def test_reference_runner_trace_temperature_001_seed_42(reference_dir, fixture_runner):
    runs = json.loads((reference_dir / "results.json").read_text())["inference_runner"]["runs"]
    first = runs[0]
    done = fixture_runner.generate([Request(first["prompt_ids"], temperature=0.01, nucleus_p=1.0,
                                            rng_seed=42, max_len=len(first["generated_ids"]))])[0]
    assert done.token_ids == first["generated_ids"]
