"""``quantize_params``: quantize a float checkpoint without running the model.

The abstract quantized params (``jax.eval_shape`` of the PTQ model's ``init``, or
an abstract NNX PTQ model) hold, at each quantized weight, a
:class:`~qflax.qparam.QuantizedParam` whose recipe says how to quantize it, and at
each static activation scale an :class:`~qflax.qparam.ActScale` naming its
statistic. This walks the float params, applies the recipes (the same compiled
function the model uses, so the result is bit-identical), and fills static
scales from ``quant_stats``.

``params`` may hold only part of the model (e.g. one layer at a time, to load a
large checkpoint piece by piece): every entry must exist in the abstract tree,
unless ``allow_extra_params`` drops unknown entries (as Qwix does), and each
module it holds must have all of its params. Weights to quantize must be float and
finite: an integer dtype or a NaN/inf value raises, naming the param.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from qflax import stats
from qflax.qparam import ActScale, QuantizedParam, check_finite_weight, quantize_param

Path = tuple[str, ...]


def quantize_params(
    params: Any,
    abstract_quantized_params: Any,
    quant_stats: Any = None,
    *,
    allow_extra_params: bool = False,
) -> dict:
    """Quantizes float ``params`` as ``abstract_quantized_params`` describes.

    Args:
        params: Nested dict of float arrays (Linen ``variables["params"]``, boxed
            or not; NNX ``nnx.to_pure_dict(nnx.state(model))``), or a subtree of it
            with full paths.
        abstract_quantized_params: The PTQ model's params (Linen, e.g.
            ``jax.eval_shape(qmodel.init, key, x)["params"]``) or the (abstract) PTQ
            NNX model; leaves may be ``jax.ShapeDtypeStruct``.
        quant_stats: The ``quant_stats`` collection of a calibrated QtProvider
            model (Linen dict, or NNX model/state), for static activation scales.
        allow_extra_params: Drop entries unknown to the abstract tree (params
            the quantized model does not use, e.g. a loss head) instead of raising.

    Returns:
        A nested dict shaped like ``params``: quantized weights become
        QuantizedParams and the static scales of modules in ``params`` (and of
        modules without params of their own above them) are added; entries dropped
        by ``allow_extra_params`` are left out.

    Raises:
        TypeError: For trees that are not nested dicts (or NNX modules/states), a
            leaf that is not an array, or a non-float value where the model
            quantizes a float param (naming the path and the dtype).
        ValueError: For an entry missing from the abstract tree, an entry of the
            abstract tree missing from a module that ``params`` holds, a shape
            mismatch (naming the path and both shapes), quantized input, a weight
            with NaN or inf values (naming the path and how many), or a missing,
            empty or non-finite statistic.

    Example:
        >>> import flax.linen as nn, jax, jax.numpy as jnp
        >>> import qflax
        >>> rules = [qflax.QuantizationRule(weight_qtype="int4", tile_size=4)]
        >>> qmodel = qflax.quantize_model(nn.Dense(3), qflax.PtqProvider(rules))
        >>> x = jnp.ones((1, 8))
        >>> abstract = jax.eval_shape(qmodel.init, jax.random.key(0), x)["params"]
        >>> fp = nn.Dense(3).init(jax.random.key(1), x)["params"]
        >>> q = qflax.quantize_params(fp, abstract)
        >>> q["kernel"].qarray.qvalue.shape  # int4 codes packed two per byte
        (4, 3)
    """
    keys: dict[Path, tuple] = {}  # the trees' own keys (an nnx.List's are ints)
    flat = _flatten(params, "params", keys)
    abstract = _flatten(abstract_quantized_params, "abstract_quantized_params", keys)
    out: dict[Path, Any] = {}
    for path, value in flat.items():
        where = "/".join(path)
        if isinstance(value, QuantizedParam | ActScale):
            raise ValueError(f"params[{where!r}] is already quantized; pass float params")
        if not (hasattr(value, "shape") and hasattr(value, "dtype")):
            raise TypeError(
                f"params[{where!r}] is a {type(value).__name__}; allowed: arrays (jax or numpy)"
            )
        if path not in abstract:
            if allow_extra_params:
                continue  # dropped: the result holds the quantized model's params only
            raise ValueError(
                f"params[{where!r}] is not in abstract_quantized_params; pass "
                "allow_extra_params=True to drop entries the quantized model does not use"
            )
        target = abstract[path]
        want = tuple(target.shape)
        if tuple(np.shape(value)) != want:
            raise ValueError(
                f"params[{where!r}] has shape {tuple(np.shape(value))}, but the quantized "
                f"model expects {want}"
            )
        if isinstance(target, QuantizedParam):
            if not jnp.issubdtype(value.dtype, jnp.inexact):
                raise TypeError(
                    f"params[{where!r}] has dtype {np.dtype(value.dtype)}, but the quantized "
                    f"model quantizes it as a {np.dtype(target.dtype)} param; allowed: "
                    "floating-point values"
                )
            check_finite_weight(value, where)
            out[path] = quantize_param(value, target.recipe)
        else:
            out[path] = value
    _check_complete(flat, abstract)
    modules = _scaled_modules(flat, abstract)
    stat_tree = None if quant_stats is None else _flatten(quant_stats, "quant_stats")
    for path, target in abstract.items():
        if not isinstance(target, ActScale) or path[:-1] not in modules:
            continue
        stat_path = (*path[:-1], target.recipe.stat)
        where = "/".join(stat_path)
        stat = _stat(stat_tree, stat_path)
        if stat is None:
            raise ValueError(
                f"static scale {'/'.join(path)!r} needs quant_stats[{where!r}]: pass the "
                "quant_stats of a calibrated QtProvider model"
            )
        stats.check_seen(stat, where)
        out[path] = ActScale(stats.scale(stat, target.recipe.qtype), target.recipe)
    return traverse_util.unflatten_dict({keys.get(p, p): v for p, v in out.items()})


def is_leaf(x: Any) -> bool:
    """Whether ``x`` ends a params tree (quantized params, scales, boxes, NNX variables)."""
    return isinstance(x, QuantizedParam | ActScale | nn.meta.AxisMetadata | nnx.Variable)


def _flatten(tree: Any, name: str, keys: dict[Path, tuple] | None = None) -> dict[Path, Any]:
    """``{path: unboxed leaf}`` of a nested dict, an NNX module or an NNX state (``name``).

    Paths are tuples of strings; ``keys``, when given, maps those not in it yet to the
    tree's own keys.
    """
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    if not isinstance(tree, Mapping):
        raise TypeError(
            f"{name} is a {type(tree).__name__}; allowed: a nested dict of arrays (e.g. Linen "
            "variables['params'] or nnx.to_pure_dict(nnx.state(model))), an NNX module or state"
        )
    flat = traverse_util.flatten_dict(plain(tree), is_leaf=lambda _, x: is_leaf(x))
    result = {}
    for path, leaf in flat.items():
        result[tuple(str(p) for p in path)] = nn.meta.unbox(leaf)
        if keys is not None:
            keys.setdefault(tuple(str(p) for p in path), path)
    return result


def _scaled_modules(flat: dict[Path, Any], abstract: dict[Path, Any]) -> set[Path]:
    """The modules whose static scales ``quantize_params`` makes for ``flat``.

    The modules ``flat`` holds params of, and the modules without params of their own
    above them (an attention module whose ``q @ k`` einsum sits between its Dense
    submodules), which would otherwise never get theirs.
    """
    held = {path[:-1] for path in flat}
    owners = {path[:-1] for path, t in abstract.items() if not isinstance(t, ActScale)}
    paramless = {path[:-1] for path in abstract} - owners
    above = {m for m in paramless if any(h[: len(m)] == m for h in held)}
    return held | above


def _check_complete(flat: dict[Path, Any], abstract: dict[Path, Any]) -> None:
    """Raises if a module that ``flat`` holds lacks a param the abstract module has.

    Params may hold only some modules (a checkpoint loaded piece by piece), but a
    module they hold must be whole (static scales are made here, not given).
    """
    modules = {path[:-1] for path in flat}
    for path, target in abstract.items():
        if path[:-1] in modules and path not in flat and not isinstance(target, ActScale):
            module = "/".join(path[:-1]) or "the top-level module"
            raise ValueError(
                f"params lacks {'/'.join(path)!r}, which the quantized model has in {module}, "
                f"whose other params are given; allowed: every param of each module given"
            )


def plain(tree: Any) -> Any:
    """Nested mappings (FrozenDict, State) as plain dicts."""
    if hasattr(tree, "items") and not is_leaf(tree):
        return {k: plain(v) for k, v in tree.items()}
    return tree


def _stat(flat: dict[Path, Any] | None, path: Path) -> dict | None:
    if flat is None:
        return None
    keys = ("lo", "hi", "count")
    if all((*path, k) in flat for k in keys):
        return {k: flat[(*path, k)] for k in keys}
    return None
