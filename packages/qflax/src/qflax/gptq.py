"""GPTQ: quantize weights with second-order error feedback from calibration data.

GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers") quantizes a weight ``W`` (``K`` inputs) one
input row at a time and spreads each row's rounding error over the rows not yet
quantized, weighted by the inverse Hessian ``H = E[x^T x]`` of the layer's inputs,
so that the layer *output* ``x W`` (not ``W`` itself) stays close to float:

1. ``H`` is damped (``H + damping * mean(diag H) * I``; inputs that were always
   zero get ``H_ii = 1``), optionally permuted by decreasing ``diag H``
   (``act_order``: the most active inputs are quantized first);
2. ``U`` = the upper Cholesky factor of ``H^-1``;
3. in blocks of ``block_size`` rows, row ``i`` is quantized to ``q_i``, its error
   ``e_i = (w_i - q_i) / U_ii`` is subtracted from the later rows of the block as
   ``U_ij e_i``, and after the block the later blocks get ``U_block,rest^T E``.

Codes land exactly on the grid of the rule's qtype: each row is quantized with
qcore's :func:`~qcore.quantize_with_scale_zero_point`. Per-channel scales (and
zero points) are those :class:`~qflax.PtqProvider` computes from the original
float weight with the rule's calibration. With sub-channel tiles (groups), each
tile's scales are by default computed when GPTQ reaches the tile's first row,
from the rows as the error feedback has updated them (the reference algorithm's
default); ``static_groups=True`` takes them from the original weight instead, as
``act_order`` needs (tiles must stay contiguous in the original row order). The
result is an ordinary :class:`~qflax.QuantizedParam` with the recipe PtqProvider
expects, so the plain PTQ model serves it.

Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> import qflax
    >>> from qflax.gptq import gptq
    >>> model = nn.Dense(8)
    >>> z = jax.random.normal(jax.random.key(0), (4, 64, 16))
    >>> mix = jax.random.normal(jax.random.key(1), (16, 16))
    >>> batches = [b @ mix for b in z]  # correlated inputs
    >>> params = model.init(jax.random.key(2), batches[0])["params"]
    >>> rules = [qflax.QuantizationRule(weight_qtype="int4")]
    >>> q = gptq(qflax.CalibrationData(model, params, batches), rules, progress=False)
    >>> q["kernel"]
    QuantizedParam(int4, shape=(16, 8), compute shape=(16, 8), packed)
    >>> qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules))
    >>> rtn = qflax.quantize_params(
    ...     params, jax.eval_shape(qmodel.init, jax.random.key(0), batches[0])["params"]
    ... )
    >>> x, ref = batches[0], model.apply({"params": params}, batches[0])
    >>> def err(p):
    ...     return float(jnp.mean(jnp.abs(qmodel.apply({"params": p}, x) - ref)))
    >>> err(q) < err(rtn)
    True
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

import qcore
from qflax._calibration_data import CalibrationData, accepts_legacy
from qflax._engine.layout import box_leaves
from qflax._params import is_leaf, plain
from qflax._progress import track
from qflax.layer_stats import LayerStats, stats_or_collect
from qflax.qparam import QuantizedParam, check_finite_weight, to_compute_layout
from qflax.rule import QuantizationRule


@accepts_legacy()
def gptq(
    data: CalibrationData,
    rules: Sequence[QuantizationRule],
    *,
    block_size: int = 128,
    damping: float = 0.01,
    act_order: bool = False,
    static_groups: bool | None = None,
    stats: dict[str, LayerStats] | None = None,
    progress: bool = True,
) -> dict:
    """Quantizes the weights the rules select with GPTQ; returns ordinary PTQ params.

    Args:
        data: The model (not modified), its float params and the batches
            (:class:`~qflax.CalibrationData`); the batches may be None when
            ``stats`` is given.
        rules: The rules of the PTQ model that will serve the result
            (``qflax.quantize_model(model, qflax.PtqProvider(rules))``).
        block_size: Rows quantized together before their error is propagated to
            the remaining rows (lazy batch updates; only speed depends on it).
        damping: Added to the Hessian's diagonal, relative to its mean.
        act_order: Quantize inputs in order of decreasing Hessian diagonal.
        static_groups: Tile scales from the original weight (True) or from the
            error-updated rows when GPTQ reaches each tile (False). None: True with
            ``act_order``, else False.
        stats: Statistics from :func:`~qflax.layer_stats.collect` (with the
            Hessian), to reuse one collection for several settings.
        progress: Show progress over batches and layers.

    Returns:
        A new nested dict of params, shaped (Linen) like ``data.params``, boxes
        kept, or (NNX) like ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``
        (load it with ``nnx.replace_by_pure_dict``). GPTQ-quantized weights are
        :class:`~qflax.QuantizedParam` objects, every other entry is unchanged (the
        same float arrays). The inputs are never modified, so an interrupted call
        (``KeyboardInterrupt``) leaves them intact.

    Raises:
        ValueError: Bad arguments, no calibration data, rules the algorithm
            cannot handle (see :func:`~qflax.layer_stats.collect`), stochastic
            rounding, stacked (scanned) weights, or a Hessian that is not
            positive definite after damping.
    """
    if not (isinstance(block_size, int) and block_size > 0):
        raise ValueError(f"block_size={block_size!r} must be a positive int")
    if isinstance(damping, bool) or not (
        isinstance(damping, numbers.Real) and 0 <= damping < float("inf")
    ):
        raise ValueError(f"damping={damping!r} is not allowed; allowed: a finite number >= 0")
    _check_groups(act_order, static_groups)
    stats = stats_or_collect(stats, data, rules, progress=progress)
    tree = data.float_tree()
    flat = traverse_util.flatten_dict(plain(tree), is_leaf=lambda _, x: is_leaf(x))
    by_path = {"/".join(str(k) for k in key): key for key in flat}
    out = dict(flat)
    for path, layer in track(list(stats.items()), "GPTQ layers", progress):
        if layer.hessian is None:
            raise ValueError(f"stats[{path!r}] has no Hessian: collect(..., hessian=True)")
        if path not in by_path:
            raise ValueError(f"stats[{path!r}] names no param of the model")
        key = by_path[path]
        raw = flat[key]
        value: Any = nn.meta.unbox(raw) if isinstance(raw, nn.meta.AxisMetadata) else raw
        recipe = layer.recipe
        if tuple(np.shape(value)) != recipe.shape:
            raise ValueError(
                f"param {path!r} has shape {tuple(np.shape(value))}, but its op uses one layer "
                f"of shape {recipe.shape}; stacked (scanned/vmapped) weights are not supported"
            )
        check_finite_weight(value, path)
        w = to_compute_layout(jnp.asarray(value), recipe)
        qa = quantize_weight(
            w,
            layer.mean_hessian(),
            recipe.spec,
            axis=layer.site.axis,
            block_size=block_size,
            damping=damping,
            act_order=act_order,
            static_groups=static_groups,
            name=path,
        )
        qp = QuantizedParam(qa, recipe)
        out[key] = box_leaves(raw, qp) if isinstance(raw, nn.meta.AxisMetadata) else qp
    return traverse_util.unflatten_dict(out)


def quantize_weight(
    w: jax.Array,
    hessian: jax.Array | np.ndarray,
    spec: qcore.HowToQuantize,
    *,
    axis: int = 0,
    block_size: int = 128,
    damping: float = 0.01,
    act_order: bool = False,
    static_groups: bool | None = None,
    name: str = "weight",
) -> qcore.QArray:
    """GPTQ-quantizes one weight in its compute layout (see the module doc).

    Args:
        w: The float weight, contracted over ``axis`` (size ``K``).
        hessian: ``E[x^T x]`` of its inputs, ``(K, K)``.
        spec: The qcore spec (as :meth:`~qflax.QuantizationRule.weight_spec`
            gives it); the scales are those ``qcore.quantize(w, spec)`` computes.
        axis: The contracting axis.
        block_size: Rows per lazy-update block.
        damping: Relative diagonal damping.
        act_order: Quantize rows by decreasing ``diag(hessian)``.
        static_groups: See :func:`gptq`.
        name: Used in error messages.

    Returns:
        The QArray (packed if ``spec.pack``) with GPTQ's codes; its scales are
        ``qcore.quantize(w, spec)``'s except for tiles with dynamic groups.

    Example:
        >>> import jax, jax.numpy as jnp, qcore
        >>> w = jax.random.normal(jax.random.key(0), (8, 3))
        >>> spec = qcore.HowToQuantize(qtype="int4", channelwise_axes=(1,))
        >>> q = quantize_weight(w, jnp.eye(8), spec)  # H = I: plain rounding
        >>> bool(jnp.all(q.scale == qcore.quantize(w, spec).scale))
        True
        >>> float(jnp.max(jnp.abs(qcore.dequantize(q) - w) / q.scale))  # half a step
        0.5
    """
    w = jnp.asarray(w)
    axis = axis % w.ndim
    k = w.shape[axis]
    h = np.asarray(hessian, np.float64)
    if h.shape != (k, k):
        raise ValueError(f"{name}: Hessian shape {h.shape} does not match K={k} (axis {axis})")
    if spec.rounding == "stochastic":
        raise ValueError(f"{name}: GPTQ needs deterministic rounding, not {spec.rounding!r}")
    _check_groups(act_order, static_groups)
    plain = dataclasses.replace(spec, pack=False)
    rtn = qcore.quantize(w, plain)
    qtype = rtn.qtype
    tile = None if act_order or static_groups else _group_length(rtn, w.shape, axis)
    scale = _expand(rtn.scale.astype(jnp.float32), w.shape)
    if rtn.tensor_scale is not None:
        scale = scale * rtn.tensor_scale.astype(jnp.float32)
    zero = None if rtn.zero_point is None else _expand(rtn.zero_point, w.shape)

    def rows(a: jax.Array) -> jax.Array:
        return jnp.moveaxis(a, axis, 0).reshape(k, -1)

    perm = _hessian_order(h, act_order)
    u = _inverse_cholesky(h[np.ix_(perm, perm)], damping, name)
    w2 = rows(w.astype(jnp.float32))[perm]
    s2 = rows(scale)[perm]
    z2 = None if zero is None else rows(zero.astype(jnp.float32))[perm]
    q2, s2, z2 = _gptq_rows(
        w2,
        s2,
        z2,
        jnp.asarray(u, jnp.float32),
        qtype=qtype,
        rounding=spec.rounding,
        narrow_range=spec.narrow_range,
        block=block_size,
        group=None
        if tile is None
        else (tile, dataclasses.replace(plain, channelwise_axes=(1,), tiled_axes=())),
    )
    q2 = q2[np.argsort(perm)]
    moved = jnp.moveaxis(w, axis, 0).shape
    q = jnp.moveaxis(q2.reshape(moved), 0, axis).astype(w.dtype)
    scale, zero = rtn.scale, rtn.zero_point
    if tile is not None:  # one row per tile of the per-row scales, in the scale's layout

        def tiles(a: jax.Array, like: jax.Array) -> jax.Array:
            a = a[::tile].reshape((k // tile, *moved[1:]))
            return jnp.moveaxis(a, 0, axis).astype(like.dtype)

        scale = tiles(s2, rtn.scale)
        zero = None if zero is None or z2 is None else tiles(z2, zero)
    # q is on the grid already: re-encoding with its scales recovers its codes.
    out = qcore.quantize_with_scale_zero_point(
        q,
        qtype,
        scale,
        zero,
        tensor_scale=rtn.tensor_scale,
        rounding=spec.rounding,
        narrow_range=spec.narrow_range,
    )
    return qcore.pack(out, axis=spec.pack_axis) if spec.pack else out


def _expand(a: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """A scale-shaped array repeated to the value's full shape (generic broadcast)."""
    for i, (d, s) in enumerate(zip(shape, a.shape, strict=True)):
        if d != s:
            a = qcore.numerics.repeat(a, d // s, i)
    return a


def _check_groups(act_order: bool, static_groups: bool | None) -> None:
    if static_groups not in (None, True, False):
        raise ValueError(f"static_groups={static_groups!r} must be None, True or False")
    if act_order and static_groups is False:
        raise ValueError(
            "act_order=True needs static_groups (None or True): tiles must stay contiguous "
            "in the original row order, so their scales come from the original weight"
        )


def _group_length(rtn: qcore.QArray, shape: tuple[int, ...], axis: int) -> int | None:
    """The tile length along ``axis`` if dynamic groups apply, else None.

    Dynamic groups need tiles along the contracting axis only (one scale per output
    channel elsewhere) and no second-level tensor scale.
    """
    sshape = rtn.scale.shape
    groups = sshape[axis]
    if groups == 1 or rtn.tensor_scale is not None:
        return None
    if any(sshape[i] != shape[i] for i in range(len(shape)) if i != axis):
        return None
    return shape[axis] // groups


def _hessian_order(h: np.ndarray, act_order: bool) -> np.ndarray:
    if not act_order:
        return np.arange(h.shape[0])
    return np.argsort(-np.diag(h), kind="stable")


def _inverse_cholesky(h: np.ndarray, damping: float, name: str) -> np.ndarray:
    """Upper Cholesky factor ``U`` of the damped ``H^-1`` (``H^-1 = U^T U``), float64."""
    h = np.array(h, np.float64)
    diag = np.diag(h).copy()
    if not np.all(np.isfinite(h)):
        raise ValueError(f"{name}: the Hessian has non-finite entries (inf/NaN inputs?)")
    dead = diag == 0
    diag[dead] = 1.0  # inputs that were always 0: their rows do not affect the output
    np.fill_diagonal(h, diag)
    h[np.ix_(dead, ~dead)] = 0.0
    h[np.ix_(~dead, dead)] = 0.0
    h[np.diag_indices_from(h)] += damping * float(np.mean(diag))
    try:
        inv = np.linalg.inv(np.linalg.cholesky(h))  # L^-1, with H = L L^T
        return np.linalg.cholesky(inv.T @ inv).T
    except np.linalg.LinAlgError:
        raise ValueError(
            f"{name}: the damped Hessian is not positive definite (damping={damping}); "
            "increase damping or use more calibration data"
        ) from None


@partial(jax.jit, static_argnames=("qtype", "rounding", "narrow_range", "block", "group"))
def _gptq_rows(
    w: jax.Array,
    s: jax.Array,
    z: jax.Array | None,
    u: jax.Array,
    *,
    qtype: qcore.QType,
    rounding: str,
    narrow_range: bool,
    block: int,
    group: tuple[int, qcore.HowToQuantize] | None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The GPTQ loop on rows ``w`` ``(K, N)`` with per-element scales.

    With ``group = (tile, spec)`` (dynamic groups), the scales (and zero points) of
    rows ``i..i+tile`` are recomputed with ``spec`` (per column) from the updated
    rows when row ``i`` (a multiple of ``tile``) is reached. Returns ``(Q, s, z)``.
    """
    k = w.shape[0]
    block = min(block, k)
    if group is not None:  # whole tiles per block, so a tile's rows are in one block
        block = group[0] * max(1, block // group[0])

    def fake_quant(row: jax.Array, s_row: jax.Array, z_row: jax.Array | None) -> jax.Array:
        q = qcore.quantize_with_scale_zero_point(
            row, qtype, s_row, z_row, rounding=rounding, narrow_range=narrow_range
        )
        return qcore.dequantize(q, jnp.float32)

    # Pad K to whole blocks with inert rows (weight 0, scale 1, U = I there) so one
    # compiled loop body serves every block: compile time does not grow with K.
    pad = -k % block
    kp = k + pad
    w = jnp.pad(w, ((0, pad), (0, 0)))
    s = jnp.pad(s, ((0, pad), (0, 0)), constant_values=1.0)
    z = None if z is None else jnp.pad(z, ((0, pad), (0, 0)))
    u = jnp.pad(u, ((0, pad), (0, pad))) + jnp.diag(
        jnp.concatenate([jnp.zeros(k, u.dtype), jnp.ones(pad, u.dtype)])
    )
    n = w.shape[1]

    def run_block(b, carry):
        w, q, s, z = carry
        b0 = b * block
        w1 = jax.lax.dynamic_slice(w, (b0, 0), (block, n))
        s1 = jax.lax.dynamic_slice(s, (b0, 0), (block, n))
        z1 = None if z is None else jax.lax.dynamic_slice(z, (b0, 0), (block, n))
        u_rows = jax.lax.dynamic_slice(u, (b0, 0), (block, kp))
        u1 = jax.lax.dynamic_slice(u_rows, (0, b0), (block, block))

        def regroup(i, w1, s1, z1):
            assert group is not None
            tile, spec = group
            qa = qcore.quantize(jax.lax.dynamic_slice(w1, (i, 0), (tile, n)), spec)
            s1 = jax.lax.dynamic_update_slice(
                s1, jnp.broadcast_to(qa.scale.astype(s1.dtype), (tile, n)), (i, 0)
            )
            if z1 is not None and qa.zero_point is not None:
                zp = jnp.broadcast_to(qa.zero_point.astype(z1.dtype), (tile, n))
                z1 = jax.lax.dynamic_update_slice(z1, zp, (i, 0))
            return s1, z1

        def body(i, carry):
            w1, q1, e1, s1, z1 = carry
            if group is not None:
                s1, z1 = jax.lax.cond(
                    i % group[0] == 0,
                    lambda: regroup(i, w1, s1, z1),
                    lambda: (s1, z1),
                )
            row = w1[i]
            qi = fake_quant(row, s1[i], None if z1 is None else z1[i])
            err = (row - qi) / u1[i, i]
            # U is upper triangular: rows before i are untouched, row i becomes qi.
            w1 = w1 - u1[i][:, None] * err[None, :]
            return w1, q1.at[i].set(qi), e1.at[i].set(err), s1, z1

        zeros = jnp.zeros_like(w1)
        _, q1, e1, s1, z1 = jax.lax.fori_loop(0, block, body, (w1, zeros, zeros, s1, z1))
        # Propagate the block's errors to the later rows; rows up to this block's end
        # are quantized already (U is zero before the block), so updating them is moot.
        w = w - jnp.matmul(u_rows.T, e1, precision=jax.lax.Precision.HIGHEST)
        s = jax.lax.dynamic_update_slice(s, s1, (b0, 0))
        z = None if z is None else jax.lax.dynamic_update_slice(z, z1, (b0, 0))
        return w, jax.lax.dynamic_update_slice(q, q1, (b0, 0)), s, z

    _, q, s, z = jax.lax.fori_loop(0, kp // block, run_block, (w, jnp.zeros_like(w), s, z))
    return q[:k], s[:k], None if z is None else z[:k]
