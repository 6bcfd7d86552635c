"""Serving: the four jit-compiled functions (``ModelRunner``), batch slots, pad buckets, sampling,
tokenization, the request queue and the streaming ``run()`` (``InferenceRunner``). No model math.
"""

from runner.core import EngineCore
from runner.engine import ModelRunner
from runner.requests import Request, RequestError, TokenEvent
from runner.runner import Completion, InferenceRunner, RunStream, default_pad_sizes, sample_from_model
from runner.sampling import SampleOutput, SampleSettings, sample_token
from runner.scheduler import Scheduler
from runner.state import DecodeState, PrefillBatch
from runner.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "Completion", "DecodeState", "EngineCore", "PrefillBatch", "IncrementalDetokenizer", "InferenceRunner", "ModelRunner",
    "Request", "RequestError", "RunStream", "Scheduler", "SampleOutput", "SampleSettings", "TokenEvent", "Tokenizer",
    "default_pad_sizes",
    "sample_from_model", "sample_token",
]
