"""Parameters on disk: the safe importer for the original Grok-1 layout (and, with the checkpoint
issue, the native format and sharded restore). Only this package knows file layouts and upstream
tensor names."""

from checkpoints.grok1_layout import load_original, original_leaf_paths
from checkpoints.safe_pickle import CheckpointError, read_pickled_tensor

__all__ = ["CheckpointError", "load_original", "original_leaf_paths", "read_pickled_tensor"]
