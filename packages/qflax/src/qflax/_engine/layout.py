"""Layout algebra of quantized params: views, transposes and partitioning of their leaves.

A quantized param is stored once, in the layout of the op that quantized it (its
:class:`~qflax.qparam.Recipe`: the float param's shape, the reshapes/transposes
the module applies before the op, the spec in that compute layout). Another op
may read it in a transposed layout (a tied embedding's lookup and ``attend``):
:func:`transposition` finds the axis order that views the stored QArray as the
other op's spec. :func:`leaf_axes` and :func:`box_leaves` give each leaf of a
quantized param (codes, scales) the partitioning metadata that fits its shape.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, cast

import qcore
from qflax.qparam import QuantizedParam, Recipe

Tiles = tuple[tuple[int, int | float], ...]  # HowToQuantize.tiled_axes, normalised


def transposition(
    stored: Recipe, spec: qcore.HowToQuantize, transforms: tuple, shape: tuple[int, ...]
) -> tuple[int, ...] | None:
    """The axes permutation that views ``stored``'s QArray as ``spec`` in layout ``transforms``.

    None if no transpose does. Both layouts must be pure transposes of the
    parameter (no reshapes), and the scales, tiles and packing of ``stored`` must
    land, permuted, on ``spec``'s.
    """
    ndim = len(shape)
    p_stored, p_wanted = permutation(stored.transforms, ndim), permutation(transforms, ndim)
    if p_stored is None or p_wanted is None or len(stored.compute_shape()) != ndim:
        return None
    perm = tuple(p_stored.index(axis) for axis in p_wanted)
    if tuple(stored.compute_shape()[a] for a in perm) != tuple(shape):
        return None
    old = stored.spec
    moved = dataclasses.replace(
        old,
        channelwise_axes=tuple(sorted(perm.index(a % ndim) for a in old.channelwise_axes)),
        tiled_axes=tuple((perm.index(a % ndim), t) for a, t in cast(Tiles, old.tiled_axes)),
        pack_axis=perm.index(old.pack_axis % ndim),
    )
    wanted = dataclasses.replace(
        spec,
        channelwise_axes=tuple(sorted(a % ndim for a in spec.channelwise_axes)),
        pack_axis=spec.pack_axis % ndim,
    )
    return perm if moved == wanted else None


def shared_view(known: Recipe, recipe: Recipe, path: str) -> tuple[int, ...]:
    """How an op quantizing param ``path`` as ``recipe`` views it quantized as ``known``.

    Two ops may share one quantized param when one's layout is a transpose of the
    other's with the scales, tiles and packing moving along (a tied embedding's
    lookup and ``attend``); returns that axis order, or raises.
    """
    perm = transposition(known, recipe.spec, recipe.transforms, recipe.compute_shape())
    if perm is None or known.rotation != recipe.rotation:
        raise ValueError(
            f"param {path!r} is used by two ops that quantize it differently "
            f"({known.spec} in layout {known.transforms} vs {recipe.spec} in layout "
            f"{recipe.transforms}); give them rules that agree"
        )
    return perm


def permutation(chain: tuple, ndim: int) -> tuple[int, ...] | None:
    """The axis permutation a chain of transposes applies, or None if it reshapes."""
    perm = tuple(range(ndim))
    for kind, arg in chain:
        if kind != "transpose":
            return None
        perm = tuple(perm[i] for i in arg)
    return perm


def leaf_axes(
    qp: QuantizedParam, axes: tuple[Any, ...], mesh: Mapping[str, int] | None = None
) -> dict[str, tuple[Any, ...]]:
    """Per-leaf partitioning of a quantized param whose float param had ``axes``.

    ``qvalue`` keeps the param's axes (a packed axis holds half as many bytes);
    ``scale`` and ``zero_point`` keep them along per-channel and tiled axes (one
    scale per channel or per tile) and are replicated along reduced ones (size 1),
    as Qwix does. Given the ``mesh`` (axis name -> size), an axis whose scales do
    not split evenly over its mesh axes (2 tiles on 4 devices) is replicated too.
    A param the module reshaped before use is replicated: its axes do not map onto
    the compute layout.
    """
    qa = qp.qarray
    lead = qa.ndim - len(qp.recipe.compute_shape())
    if qp.recipe.transforms or len(axes) != qa.ndim:
        if not qp.recipe.transforms or lead == 0:
            axes = (None,) * qa.ndim
        else:
            axes = tuple(axes[:lead]) + (None,) * (qa.ndim - lead)
    scaled = tuple(
        a if s > 1 and _splits(s, a, mesh) else None
        for a, s in zip(axes, qa.scale.shape, strict=True)
    )
    return {
        "qvalue": tuple(axes),
        "scale": scaled,
        "zero_point": scaled,
        "tensor_scale": (None,) * qa.ndim,
    }


def _splits(size: int, name: Any, mesh: Mapping[str, int] | None) -> bool:
    """Whether ``size`` entries split evenly over mesh axis (or axes) ``name``."""
    if mesh is None or name is None:
        return True
    names = name if isinstance(name, tuple) else (name,)
    return size % math.prod(mesh.get(n, 1) for n in names) == 0


def box_leaves(box: Any, qp: QuantizedParam) -> Any:
    """``qp`` with each QArray leaf in its own copy of ``box`` (``nn.Partitioned``...).

    Partitioning metadata with ``names`` is adapted per leaf (:func:`leaf_axes`), so
    ``nn.get_partition_spec`` gives codes and scales shardings that fit their
    shapes; other metadata boxes the whole param.
    """
    names = getattr(box, "names", None)
    if names is None:
        return box.replace_boxed(qp)
    axes = leaf_axes(qp, tuple(names))
    qa = qp.qarray
    children, aux = qa.tree_flatten_with_keys()
    boxed = []
    for key, leaf in children:
        if leaf is not None:
            leaf = box.replace_boxed(leaf).replace(names=axes[key.name])
        boxed.append(leaf)
    s = qp.input_scale
    if s is not None:  # one entry per input channel: replicated
        s = box.replace_boxed(s).replace(names=(None,) * len(s.shape))
    return QuantizedParam(type(qa).tree_unflatten(aux, boxed), qp.recipe, s)
