"""Shared by AWQ and SmoothQuant: per-input-channel scales, folded or carried.

Both algorithms rescale the input channels of a quantized weight, ``x W = (x / s)
(s W)``, and either fold ``1/s`` into float params that scale the weight's input
linearly (a norm's scale and bias, the previous Dense's kernel columns and bias),
named per weight in a ``fold_into`` mapping, or carry ``s`` in the
:class:`~qflax.QuantizedParam` (``Recipe.input_scale_axis``), whose op divides its
input by ``s``. :func:`plan` checks the mapping against the collected statistics
and the params and groups weights that share fold targets; :func:`apply` runs an
algorithm's scale function over the groups and writes the result. Private to qflax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

import qcore
from qflax._calibration_data import CalibrationData
from qflax._engine.layout import box_leaves
from qflax._params import is_leaf, plain
from qflax._progress import track
from qflax.layer_stats import LayerStats
from qflax.qparam import QuantizedParam, check_finite_weight, to_compute_layout

Key = tuple[Any, ...]


@dataclasses.dataclass
class Plan:
    """Checked fold targets of a calibrated model.

    Attributes:
        flat: The params, flattened (``{key tuple: leaf}``, boxes kept).
        keys: ``{"/"-joined path: key tuple}`` of every param.
        groups: ``{sorted fold targets: weight paths}`` (``()``: no fold target).
    """

    flat: dict[Key, Any]
    keys: dict[str, Key]
    groups: dict[tuple[str, ...], list[str]]

    def weight(self, path: str, layer: LayerStats) -> jax.Array:
        """The float weight at ``path`` in its compute layout."""
        return weight(self.flat[self.keys[path]], layer)

    def fold(self, out: dict[Key, Any], targets: Sequence[str], s: jax.Array) -> None:
        """Writes ``target / s`` (along the last axis) into ``out`` for each target."""
        for t in targets:
            raw: Any = self.flat[self.keys[t]]
            v = jnp.asarray(value(raw))
            new = (v / along(s, v.ndim, v.ndim - 1).astype(v.dtype)).astype(v.dtype)
            out[self.keys[t]] = raw.replace_boxed(new) if boxed(raw) else new

    def put(self, out: dict[Key, Any], path: str, qp: QuantizedParam) -> None:
        """Writes the quantized weight ``qp`` at ``path`` into ``out`` (boxed like the input)."""
        raw: Any = self.flat[self.keys[path]]
        out[self.keys[path]] = box_leaves(raw, qp) if boxed(raw) else qp


ScaleFn = Callable[[Sequence[tuple[jax.Array, LayerStats]]], jax.Array]


def apply(
    folds: Plan, stats: Mapping[str, LayerStats], scale: ScaleFn, what: str, progress: bool
) -> dict:
    """Quantizes every weight of ``stats`` times its scale; folds or carries the scale.

    Weights sharing fold targets get one ``scale(their (weight, stats) pairs)``,
    folded into the targets; a weight without a fold target gets its own, carried
    in its :class:`~qflax.QuantizedParam`. Returns a new nested dict of params.
    """
    out = dict(folds.flat)
    units: list[tuple[tuple[str, ...], list[str]]] = []
    for ts, members in folds.groups.items():
        units += [(ts, members)] if ts else [((), [w]) for w in members]
    for ts, members in track(units, f"{what} layers", progress):
        weights = [(folds.weight(w, stats[w]), stats[w]) for w in members]
        s = scale(weights)
        if ts:
            folds.fold(out, ts, s)
        for w, (wc, layer) in zip(members, weights, strict=True):
            qa = quantize_scaled(wc, layer, s)
            if ts:
                qp = QuantizedParam(qa, layer.recipe)
            else:
                recipe = dataclasses.replace(layer.recipe, input_scale_axis=layer.site.axis)
                qp = QuantizedParam(qa, recipe, s)
            folds.put(out, w, qp)
    return traverse_util.unflatten_dict(out)


def plan(
    data: CalibrationData,
    stats: Mapping[str, LayerStats],
    fold_into: Mapping[str, str | Sequence[str]] | None,
) -> Plan:
    """Checks ``fold_into`` against the quantized weights and the params, and groups them.

    Raises:
        ValueError: A key that is not a quantized weight, a target that is not a
            param, is itself quantized, or whose last axis is not the weight's
            number of input channels; a target shared by weights with different
            target sets. Messages name the entry, the value and what is allowed.
    """
    if fold_into is None:
        fold_into = {}
    if not isinstance(fold_into, Mapping):
        raise ValueError(
            f"fold_into={fold_into!r} must be a mapping {{weight path: param path(s)}}, "
            f"e.g. {{'dense/kernel': 'norm/scale'}}; quantized weights: {list(stats)}"
        )
    tree = data.float_tree()
    flat = traverse_util.flatten_dict(plain(tree), is_leaf=lambda _, x: is_leaf(x))
    keys = {"/".join(str(k) for k in key): key for key in flat}
    floats = [p for p in keys if p not in stats]
    targets: dict[str, tuple[str, ...]] = {}
    for w, t in fold_into.items():
        targets[w] = (t,) if isinstance(t, str) else tuple(t)
    for w, ts in targets.items():
        if w not in stats:
            raise ValueError(
                f"fold_into[{w!r}]: no quantized weight of that path (quantized: {list(stats)})"
            )
        if not ts or not all(isinstance(t, str) for t in ts):
            raise ValueError(
                f"fold_into[{w!r}]={fold_into[w]!r} must be a param path or a non-empty "
                f"sequence of param paths (float params: {floats})"
            )
        for t in ts:
            if t not in keys:
                raise ValueError(
                    f"fold_into[{w!r}]: {t!r} is not a param of the model (float params: {floats})"
                )
            if t in stats:
                raise ValueError(
                    f"fold_into[{w!r}]: {t!r} is quantized by the rules; fold into a float "
                    f"param (quantizing the previous layer after folding is not supported; "
                    f"float params: {floats})"
                )
            k = int(np.shape(value(flat[keys[t]]))[-1]) if np.ndim(value(flat[keys[t]])) else 0
            if k != channels(stats[w]):
                raise ValueError(
                    f"fold_into[{w!r}]: {t!r} has shape {np.shape(value(flat[keys[t]]))} with "
                    f"{k} entries on its last axis, the weight has {channels(stats[w])} input "
                    "channels (allowed: params whose last axis has one entry per input channel)"
                )
    groups: dict[tuple[str, ...], list[str]] = {}
    for w in stats:
        groups.setdefault(tuple(sorted(targets.get(w, ()))), []).append(w)
    owner: dict[str, tuple[str, ...]] = {}
    for ts in groups:
        for t in ts:
            if owner.setdefault(t, ts) != ts:
                raise ValueError(
                    f"fold_into: {t!r} is a fold target of weights with different target sets "
                    f"({owner[t]} and {ts}); weights sharing an input must list the same targets"
                )
    return Plan(flat, keys, groups)


def quantize_scaled(w: jax.Array, layer: LayerStats, s: jax.Array) -> qcore.QArray:
    """Quantizes the compute-layout weight ``w`` times ``s`` (along its contracting axis)."""
    w = (w.astype(jnp.float32) * along(s, w.ndim, layer.site.axis)).astype(w.dtype)
    return qcore.quantize(w, layer.recipe.spec)


def along(s: jax.Array, ndim: int, axis: int) -> jax.Array:
    """``s`` (shape ``(K,)``) reshaped to broadcast along ``axis`` of a rank-``ndim`` array."""
    shape = [1] * ndim
    shape[axis] = s.shape[0]
    return s.reshape(shape)


def channels(layer: LayerStats) -> int:
    """The weight's number of input channels."""
    return int(layer.abs_sum.shape[0])


def boxed(raw: Any) -> bool:
    """Whether ``raw`` is a Linen metadata box (e.g. ``nn.Partitioned``)."""
    return isinstance(raw, nn.meta.AxisMetadata)


def value(raw: Any) -> Any:
    """``raw`` unboxed."""
    return nn.meta.unbox(raw) if boxed(raw) else raw


def weight(raw: Any, layer: LayerStats) -> jax.Array:
    """The float weight in its compute layout (one layer; stacked weights raise)."""
    v = jnp.asarray(value(raw))
    if tuple(v.shape) != layer.recipe.shape:
        raise ValueError(
            f"param {layer.site.path!r} has shape {tuple(v.shape)}, but its op uses one "
            f"layer of shape {layer.recipe.shape}; stacked weights are not supported"
        )
    check_finite_weight(v, layer.site.path)
    return to_compute_layout(v, layer.recipe)
