"""The output structure of an exported function, as JSON in the model's metadata.

A :class:`~qort.Session` made from a ``.onnx`` file has no Python object to ask for
the structure, so the converter writes it under :data:`KEY` in ``metadata_props``:
a leaf is its output index, ``None`` is ``null``, and lists, tuples and dicts (string
keys) are ``{"list": [...]}``, ``{"tuple": [...]}``, ``{"dict": [[key, ...], ...]}``.
Structures with other nodes (named tuples, dataclasses...) are not written; a
session from the file then returns the outputs as a flat tuple.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jax

KEY = "qort.output_structure"


class _Leaf:
    def __init__(self, index: int) -> None:
        self.index = index


def encode(treedef: Any) -> str | None:
    """The JSON description of ``treedef``, or None when it has other node types."""
    tree = jax.tree.unflatten(treedef, [_Leaf(i) for i in range(treedef.num_leaves)])

    def enc(node: Any) -> Any:
        if isinstance(node, _Leaf):
            return node.index
        if node is None:
            return None
        if type(node) is list:
            return {"list": [enc(x) for x in node]}
        if type(node) is tuple:
            return {"tuple": [enc(x) for x in node]}
        if type(node) is dict and all(isinstance(k, str) for k in node):
            return {"dict": [[k, enc(v)] for k, v in node.items()]}
        raise TypeError(type(node).__name__)

    try:
        return json.dumps(enc(tree), separators=(",", ":"))
    except TypeError:
        return None


def decode(text: str, leaves: Sequence[Any]) -> Any:
    """The outputs ``leaves`` in the structure described by ``text``."""

    def dec(node: Any) -> Any:
        if node is None:
            return None
        if isinstance(node, int):
            return leaves[node]
        ((kind, items),) = node.items()
        if kind == "dict":
            return {k: dec(v) for k, v in items}
        values = [dec(x) for x in items]
        return tuple(values) if kind == "tuple" else values

    return dec(json.loads(text))
