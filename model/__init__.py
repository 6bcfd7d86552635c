"""The Grok-1 network: config, layers, KV memory and int8 weights. No I/O, no host loop.

Flax linen, applied functionally: ``LanguageModel(config).apply({"params": params}, ...)``.
Linen was chosen over NNX because its parameters are already a plain nested dict (the pytree that
checkpoints and sharding rules map over) with Grok-1's own Haiku names, and ``apply`` is a pure
function that jits with no split/merge step; ``sow`` gives the per-layer intermediates the parity
tests need.

Shape suffixes in this package: B batch, T tokens this call, S cache length, D emb_size,
N q heads, K kv heads, G q heads per kv head, H key_size, F ffn, E experts, k selected experts,
V vocab, M flattened tokens (B*T), R (token, expert slot) rows.
"""

from model.config import GROK_1, GROK_1_REFERENCE_TINY, GROK_2, PRESETS, TINY, TINY_GROK2, ModelConfig, ffn_size
from model.memory import KV_DTYPES, KVMemory, QuantizedKV, new_memory, quantize_kv
from model.quant import QuantizedWeight8bit, dequantize, is_quantized, quantize
from model.transformer import ForwardOutput, LanguageModel, forward, init_params

__all__ = [
    "GROK_1", "GROK_1_REFERENCE_TINY", "GROK_2", "PRESETS", "TINY", "TINY_GROK2", "ModelConfig", "ffn_size",
    "KVMemory", "KV_DTYPES", "QuantizedKV", "quantize_kv", "new_memory",
    "QuantizedWeight8bit", "dequantize", "is_quantized", "quantize",
    "ForwardOutput", "LanguageModel", "forward", "init_params",
]
