"""The shipped default model (checkpoints/austen-moe): its card's figures, its tokenizer, its text."""

import json
import os

import pytest

from tests.helpers import REPO, SHARED_DATA, first_layer

DEFAULT = REPO / "checkpoints" / "austen-moe"


@pytest.fixture(scope="module")
def metrics():
    if not (DEFAULT / "config.json").is_file():
        pytest.fail(f"the default model is missing from {DEFAULT}")
    return json.loads((DEFAULT / "metrics.json").read_text())


def test_heldout_loss_matches_the_model_card(metrics):
    if not (SHARED_DATA / "austen.txt").is_file():
        pytest.skip("../shared/data/austen.txt is needed to rebuild the held-out set")
    from train.evaluate import heldout_loss

    loss = heldout_loss(str(DEFAULT), max_windows=metrics["heldout_subset_windows"])
    assert abs(loss - metrics["heldout_loss_subset"]) / metrics["heldout_loss_subset"] < 0.01
    assert loss < 0.6 * metrics["uniform_loss"]  # far below guessing uniformly over the vocabulary


def test_tokenizer_vocabulary_equals_the_config():
    from checkpoints.native import open_native
    from tokenization import SentencePieceTokenizer as Tokenizer

    config, _, tokenizer = open_native(str(DEFAULT))
    assert tokenizer is not None and Tokenizer(tokenizer).vocab_size == config.vocab_size
    assert os.path.getsize(DEFAULT / "tokenizer.model") > 0


def test_size_is_within_25_mb():
    total = sum(f.stat().st_size for f in DEFAULT.iterdir() if f.is_file())
    assert total <= 25 * 2**20


def test_greedy_generation_is_not_degenerate(shipped_runner):
    done = shipped_runner.generate(["It is a truth universally acknowledged, that"], temperature=0.0,
                                   max_len=40)[0]
    assert len(set(done.token_ids)) >= 10  # not one token repeated
    words = done.text.split()
    assert len(words) >= 15 and max(words.count(w) for w in set(words)) < len(words) / 3


def test_run_py_uses_the_default_model(capsys):
    import sys

    sys.path.insert(0, str(REPO))
    import run

    # its compiled steps in the session's store ($GROK_RUNNER_COMPILE_CACHE): those the shipped
    # runner's tests compiled are loaded
    assert run.main(["--prompt", "Mr. Darcy", "--max-tokens", "12", "--seed", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Mr. Darcy") and len(out.split()) > 4
    assert "time to first token" in err and "compilations" in err



def test_the_shipped_int8_weights_are_read_as_int8_with_the_dequantised_logits():
    """The shipped checkpoint's int8 experts and projections, on the int8 kernels (backend='cpu'):
    no float copy, and the logits and greedy tokens of its float32 copy on XLA."""
    import numpy as np

    from backends.cpu import build, ops
    from runner import InferenceRunner, ModelRunner

    if not build.available():
        pytest.skip(f"CPU kernels: {build.unavailable_reason()}")
    runners = [InferenceRunner(runner=ModelRunner(checkpoint_path=str(DEFAULT), backend="cpu"), batch_size=1),
               InferenceRunner(runner=ModelRunner(checkpoint_path=str(DEFAULT), backend="xla", dequantize=True),
                               batch_size=1)]
    for runner in runners:
        runner = runner.initialize(warmup=False)  # only the variants the test uses are compiled
    int8, floats = (runner.engine.executor for runner in runners)
    layer = first_layer(int8.params)
    assert isinstance(layer["moe"]["linear"]["w"], ops.Int8PanelWeight)
    assert isinstance(layer["multi_head_attention"]["value"]["w"], ops.Int8PanelWeight)
    assert floats.params["transformer"]["layers"]["moe"]["linear"]["w"].dtype == np.float32  # XLA's: stacked
    prompt = "It is a truth universally acknowledged, that"
    tokens = np.asarray([runners[0].tokenizer.encode(prompt)], np.int32)
    lengths = np.array([tokens.shape[1]], np.int32)
    a, b = (np.asarray(r.forward(r.params, tokens, lengths)) for r in (int8, floats))
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    first, second = (r.generate([prompt], temperature=0.0, max_len=24)[0].token_ids for r in runners)
    assert first == second
