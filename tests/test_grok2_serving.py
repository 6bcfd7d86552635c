"""A tiny Grok-2, as people download it (a Hugging Face directory: sglang's names, the experts
split 8 ways over TP files, Grok-2's tiktoken tokenizer), served like Grok-1: every request's
output equals its solo run under the scheduler, with the prefix cache, with int8 KV and with
speculation; greedy equals the full forward past the attention temperature's length and YaRN's
original context; structured output through the tiktoken vocabulary."""

import dataclasses
import json

import jax
import jsonschema
import numpy as np
import pytest

from backends import XLA
from model import TINY_GROK2, forward
from runner import InferenceRunner, ModelRunner, Request
from tests.hf_writers import write_hf
from tests.test_grok2 import grok2_params
from tests.tokenizer_files import write_tiktoken_json

CONFIG = dataclasses.replace(TINY_GROK2, vocab_size=512)
PAD_SIZES = (8, 16, 32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("grok2-hf")
    params = grok2_params(CONFIG, seed=1)
    write_hf(root / "hf", params, CONFIG, "sglang", tp=8, tokenizer=write_tiktoken_json(root / "tok"))
    return str(root / "hf"), params


def make_runner(path, **fields):
    model = {key: fields.pop(key) for key in ("kv_dtype",) if key in fields}
    runner = InferenceRunner(runner=ModelRunner(checkpoint_path=path, **model), batch_size=4, pad_sizes=PAD_SIZES,
                             max_num_batched_tokens=32, **fields)
    return runner.initialize(warmup=False)  # the variants the tests call, compiled (or loaded) as they call them


@pytest.fixture(scope="module")
def runner(checkpoint):
    """The scheduler with the prefix cache and speculation (n-gram drafts of 3)."""
    return make_runner(checkpoint[0], prefix_cache_blocks=24, prefix_block_size=8, speculative=3)


@pytest.fixture(scope="module")
def int8_runner(checkpoint):
    return make_runner(checkpoint[0], kv_dtype="int8", prefix_cache_blocks=24, prefix_block_size=8)


def prompt_ids(i, length):
    return np.random.default_rng(i).integers(3, CONFIG.vocab_size, length).tolist()


def mixed_requests(n, offset=0):
    lengths = [1, 7, 9, 17, 20, 33, 12, 40]
    shared = prompt_ids(999, 16)  # two blocks of a prefix some requests share
    requests = []
    for i in range(n):
        prompt = prompt_ids(offset + i, lengths[i % len(lengths)])
        if i % 3 == 0:
            prompt = shared + prompt
        settings = [dict(temperature=0.0), dict(temperature=1.0, rng_seed=i),
                    dict(temperature=0.7, nucleus_p=0.9, rng_seed=100 + i)][i % 3]
        requests.append(Request(prompt, max_len=4 + (i * 5) % 17, **settings))
    return requests


def tokens_by_request(stream):
    out = {}
    for event in stream:
        if event.token_id is not None:
            out.setdefault(event.request_id, []).append(event.token_id)
    return out


# int8_runner with -m slow: its cheaper siblings in the default run are the case of runner here
# (Grok-2's steps) and tests/test_kv_int8.py's neighbours test (the int8 cache's)
@pytest.mark.parametrize("which", ["runner", pytest.param("int8_runner", marks=pytest.mark.slow)])
def test_each_request_alone_equals_among_many(request, which):
    r = request.getfixturevalue(which)
    requests = mixed_requests(12, offset=10 if which == "runner" else 40)
    together = tokens_by_request(r.run(requests))
    for req in requests:
        alone = tokens_by_request(r.run([dataclasses.replace(req, request_id=None)]))
        assert together[req.request_id] == next(iter(alone.values())), req


def test_greedy_equals_the_full_forward_past_every_grok2_length(runner, checkpoint):
    """Decoding crosses 8 (the temperature's length), 16 (YaRN's original context) and 32; the
    speculative runner's tokens are the model's argmax, recomputed here without any cache."""
    params = checkpoint[1]
    fwd = jax.jit(lambda p, t, n: forward(p, t, CONFIG, lengths=n, backend=XLA()).logits)
    prompt = prompt_ids(7, 6)
    got = runner.generate([prompt], temperature=0.0, max_len=36)[0].token_ids
    seq = list(prompt)
    for token in got:
        padded = np.zeros((1, CONFIG.sequence_len), np.int32)
        padded[0, :len(seq)] = seq
        assert token == int(np.asarray(fwd(params, padded, np.array([len(seq)])))[0, len(seq) - 1].argmax())
        seq.append(token)
    assert len(seq) > 40


def test_scoring_equals_generation_on_a_sequence_holding_id_0(runner):
    """Grok-2 masks keys by position in every path (as sglang): the runner's scoring forward
    (``InferenceRunner.logits``: echo) gives each greedy token of a prompt holding id 0
    (``<|pad|>``) the log-probability generation gave it, and makes it the argmax."""
    prompt = prompt_ids(8, 12)
    prompt[1] = prompt[5] = prompt[6] = 0
    done = runner.generate([prompt], temperature=0.0, max_len=10, logprobs=0)[0]
    seq = np.array([prompt + done.token_ids[:-1]], np.int32)
    logits = runner.logits(seq, np.array([seq.shape[1]]))[0, len(prompt) - 1:]
    logprobs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    assert logits.argmax(-1).tolist() == done.token_ids
    np.testing.assert_allclose(logprobs[np.arange(len(done.token_ids)), done.token_ids], done.logprobs, atol=1e-4)


def test_a_long_prompt_is_served_or_a_400_naming_prompt(runner):
    """Grok-2's tiktoken tokenizer bounds a prompt's tokens as SentencePiece does (once a 500:
    the runner asked every tokenizer for SentencePiece's max_piece_chars). A prompt of more
    characters than the context's positions that fits is served; one that does not, or one
    refused by the bound before it is encoded, is a 400 naming the prompt."""
    import httpx

    from server import Server
    from tests.test_server import LiveServer

    fits = "the house " * 7  # 70 characters
    assert len(fits) >= CONFIG.sequence_len > len(runner.tokenizer.encode(fits)) + 4
    long = "the house " * 40
    assert len(runner.tokenizer.encode(long)) >= CONFIG.sequence_len
    huge = "the house " * 100_000
    assert runner.tokenizer.min_tokens(huge) >= CONFIG.sequence_len
    live = LiveServer(Server(runner, "tiny-grok-2"))
    try:
        body = {"model": "tiny-grok-2", "max_tokens": 4, "temperature": 0}
        r = httpx.post(live.url + "/v1/completions", json=dict(body, prompt=fits), timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        for prompt, why in ((long, "tokens, more than"), (huge, "bytes, at most")):
            r = httpx.post(live.url + "/v1/completions", json=dict(body, prompt=prompt), timeout=120)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "prompt" and why in error["message"], error
    finally:
        live.stop()


def test_structured_output_through_the_tiktoken_vocabulary(runner):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    for seed in range(3):
        done = runner.complete(Request(prompt_ids(60 + seed, 5), temperature=1.0, rng_seed=seed, max_len=56,
                                       json_schema=schema))
        jsonschema.validate(json.loads(done.text), schema)


def test_the_tokenizer_and_config_come_from_the_directory(runner):
    assert runner.tokenizer.kind == "tiktoken" and runner.config == CONFIG
    assert runner.tokenizer.decode(runner.tokenizer.encode("the house")) == "the house"


def test_chat_is_written_in_grok2s_format(runner, checkpoint):
    from server.chat import ChatTemplate

    template = ChatTemplate.for_checkpoint(checkpoint[0])
    ids = template.prompt([{"role": "user", "content": "the house"}], tokenizer=runner.tokenizer,
                          context=CONFIG.sequence_len)
    ids = runner.tokenizer.encode(ids) if isinstance(ids, str) else ids
    assert runner.tokenizer.decode(ids) == "Human: the house\n\nAssistant:"  # the separator is a special token
    assert ids.count(1) == 1
