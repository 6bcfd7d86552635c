"""Shared test helpers (importable by subprocess workers without conftest's device setup)."""

import pathlib

import jax

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
REFERENCE = SHARED_DATA / "grok1_reference"


def lively(params, factor: float = 30.0):
    """Random parameters whose greedy output depends on the context.

    With random tied embeddings the token's own embedding dominates the residual stream and greedy
    decoding repeats the last token, which would let cache bugs pass unseen; scaling the post-norms
    makes attention and the MoE dominate instead.
    """
    params = jax.tree_util.tree_map(lambda x: x, params)
    for layer in params["transformer"].values():
        for name in ("rms_norm_1", "rms_norm_3"):
            layer[name]["scale"] = layer[name]["scale"] * factor
    return params


def first_layer(params):
    """Layer 0's parameters, in a backend's layout or canonical: held apart (``decoder_layer_0``,
    an unrolled stack) or taken from the stacked layers (``layers``: scan, indexed), each layout
    type kept (a stacked ``PanelWeight``'s layer 0 is a ``PanelWeight``)."""
    tree = params["transformer"]
    if "decoder_layer_0" in tree:
        return tree["decoder_layer_0"]
    return jax.tree_util.tree_map(lambda a: a[0], tree["layers"])
