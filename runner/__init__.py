"""Serving: the client-facing ``InferenceRunner`` and the ``Engine`` behind it (a round is the
``Scheduler``'s plan, the ``Executor``'s device calls, the ``OutputProcessor``'s events), batch
slots, pad buckets, sampling, tokenization and the streaming ``run()``. No model math.

Who holds what: ``ModelRunner`` (``model_runner.py``) says which model and how; ``Executor``
(``executor.py``) the parameters, the decode state and the jitted steps (``steps.py``;
speculation's in ``speculative.py``); ``Scheduler`` (``scheduler.py``) the requests, slots and KV
blocks (the prefix cache's index, ``prefix_cache.py``); ``OutputProcessor`` (``outputs.py``)
detokenizers, grammar matchers and events; ``Engine`` (``engine.py``) the rounds and the client
API; ``InferenceRunner`` (``runner.py``) the reference's fields and the streams.
"""

from runner.engine import Engine
from runner.executor import Executor
from runner.model_runner import ModelRunner
from runner.requests import Request, RequestError, TokenEvent
from runner.runner import Completion, InferenceRunner, RunStream, default_pad_sizes, sample_from_model
from runner.sampling import SampleOutput, SampleSettings, sample_token
from runner.scheduler import Scheduler
from runner.state import DecodeState, PrefillBatch
from tokenization import IncrementalDetokenizer, Tokenizer

__all__ = [
    "Completion", "DecodeState", "Engine", "Executor", "IncrementalDetokenizer", "InferenceRunner", "ModelRunner",
    "PrefillBatch", "Request", "RequestError", "RunStream", "Scheduler", "SampleOutput", "SampleSettings",
    "TokenEvent", "Tokenizer", "default_pad_sizes", "sample_from_model", "sample_token",
]
