"""Parameters on disk: the native format (config.json + safetensors + tokenizer), the safe
importer of the original Grok-1 layout, the converter, and sharded restore onto a mesh. Only this
package knows file layouts and upstream tensor names."""

from checkpoints.grok1_layout import load_original, open_original, original_leaf_paths
from checkpoints.native import open_native, save
from checkpoints.restore import Restored, restore
from checkpoints.safe_pickle import CheckpointError, read_pickled_tensor

__all__ = [
    "CheckpointError", "Restored", "load_original", "open_native", "open_original",
    "original_leaf_paths", "read_pickled_tensor", "restore", "save",
]
