"""QArray: quantized codes with their scales, and quantize / dequantize.

A :class:`QArray` holds ``qvalue`` (codes), ``scale``, an optional
``zero_point`` and, for nvfp4, a per-tensor ``tensor_scale``, plus static
metadata (the :class:`~qcore.qtypes.QType`, the dequantized dtype and how the
codes are packed). It is a JAX pytree, so it passes through ``jax.jit``,
``jax.vmap``, ``jax.tree.map`` and sharding like any array.

Scales follow the *generic broadcast* rule: ``scale`` has the rank of the value
and each of its dims divides the value's dim. A scale dim equal to the value dim
is per-channel, ``1`` is per-tensor along that axis, anything in between is a
tile of ``dim // scale_dim`` consecutive elements. Per-tensor, per-channel,
sub-channel tiles and 2-D tiles are all just scale shapes.

``dequantize(quantize(x, how))`` of a uniform integer type is within half a
step (``scale / 2``) of ``x`` wherever ``x`` lies inside the calibrated range;
values outside it saturate.

Example:
    >>> import jax.numpy as jnp
    >>> from qcore import HowToQuantize, dequantize, quantize
    >>> x = jnp.arange(12.0).reshape(3, 4) - 5.5
    >>> q = quantize(x, HowToQuantize(qtype="int8", channelwise_axes=(0,)))
    >>> q
    QArray(int8, shape=(3, 4), dtype=float32, scale=(3, 1))
    >>> bool(jnp.all(jnp.abs(dequantize(q) - x) <= q.scale / 2 + 1e-6))
    True
    >>> q4 = quantize(x, HowToQuantize(qtype="int4", tiled_axes={1: 2}, pack=True))
    >>> q4.scale.shape, q4.qvalue.shape, q4.qvalue.dtype
    ((1, 2), (3, 2), dtype('uint8'))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from qcore import calibration as calibration_lib
from qcore import numerics, packing, qtypes
from qcore.qtypes import QType

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class HowToQuantize:
    """How to quantize an array: a frozen, hashable spec.

    Attributes:
        qtype: A :class:`~qcore.qtypes.QType` or its name (``"int8"``, ``"nf4"``...).
        channelwise_axes: Axes that get one scale per index (per-channel); an
            int means that one axis. Each axis once.
        tiled_axes: ``{axis: tile}`` (or ``(axis, tile)`` pairs); an ``int`` tile
            is a length, a ``float`` in ``(0, 1)`` a fraction of the axis (``0.25``
            = 4 tiles). Block-scaled types (mx, nvfp4) tile the innermost axis
            that is not channelwise with their block size unless an axis is given
            here. Each axis once (``1`` and ``-1`` name the same axis of a
            matrix); an axis is either channelwise or tiled.
        calibration: A calibration string (see :mod:`qcore.calibration`) or
            calibrator. Other axes are reduced.
        rounding: ``"nearest_even"``, ``"away_from_zero"`` or ``"stochastic"``.
        symmetric: ``False`` adds a zero point (uniform integer types only).
        narrow_range: Signed integers skip their most negative code
            (``int8`` → ``[-127, 127]``), and the bound maps to ``qmax`` exactly.
        scale_dtype: Floating-point dtype of the stored scale; ``None`` keeps the
            input's dtype. Block-scaled types always store their own scale dtype.
            A scale below the dtype's smallest normal value is raised to it.
        pack: Pack sub-byte codes into ``uint8`` (see :mod:`qcore.packing`).
        pack_axis: The axis along which codes are packed.
    """

    qtype: QType | str
    channelwise_axes: Sequence[int] = ()
    tiled_axes: Mapping[int, int | float] | Sequence[tuple[int, int | float]] = ()
    calibration: str | calibration_lib.Calibrator = "absmax"
    rounding: str = "nearest_even"
    symmetric: bool = True
    narrow_range: bool = False
    scale_dtype: Any = None
    pack: bool = False
    pack_axis: int = -1

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        qtype = qtypes.get(self.qtype)
        set_(self, "qtype", qtype)
        channel = self.channelwise_axes
        channel = (channel,) if _is_int(channel) else channel  # ``channelwise_axes=1``
        channel = tuple(_int_arg("channelwise_axes", channel))
        if len(set(channel)) != len(channel):
            raise ValueError(
                f"channelwise_axes={self.channelwise_axes!r} repeats an axis; allowed: each "
                "axis once"
            )
        set_(self, "channelwise_axes", channel)
        tiles = _tile_pairs(self.tiled_axes)
        for axis, tile in tiles:
            ok = isinstance(tile, int) and tile > 0 or isinstance(tile, float) and 0 < tile < 1
            if not ok or isinstance(tile, bool):
                raise ValueError(
                    f"tiled_axes={dict(tiles)}: tile {tile!r} of axis {axis} must be a "
                    "positive int (tile length) or a float in (0, 1) (fraction of the axis)"
                )
        overlap = {a for a, _ in tiles} & set(channel)
        if overlap:
            raise ValueError(
                f"axes {sorted(overlap)} are in both channelwise_axes="
                f"{channel} and tiled_axes={dict(tiles)}; an axis is one or the other"
            )
        set_(self, "tiled_axes", tiles)
        set_(self, "calibration", calibration_lib.parse(self.calibration))
        numerics.check_rounding(self.rounding, qtype)
        for name in ("symmetric", "narrow_range", "pack"):
            value = getattr(self, name)
            if not isinstance(value, bool | np.bool_):
                raise ValueError(f"{name}={value!r} must be a bool; allowed: True or False")
        if not _is_int(self.pack_axis):
            raise ValueError(f"pack_axis={self.pack_axis!r} must be an int (an axis of x)")
        if not self.symmetric and not qtype.supports_asymmetric:
            raise ValueError(
                f"symmetric=False needs a uniform integer qtype (int*/uint*); qtype="
                f"{qtype.name!r} (kind {qtype.kind!r}) cannot hold a zero point"
            )
        if self.scale_dtype is not None:
            set_(self, "scale_dtype", _float_dtype("scale_dtype", self.scale_dtype))
        if self.pack and not qtype.packable:
            raise ValueError(
                f"pack=True needs a sub-byte qtype; qtype={qtype.name!r} stores "
                f"{qtype.bits} bits in {qtype.storage} already"
            )

    @property
    def resolved_qtype(self) -> QType:
        """The qtype as a :class:`~qcore.qtypes.QType`."""
        return qtypes.get(self.qtype)

    def scale_shape(self, shape: Sequence[int]) -> Shape:
        """The scale shape this spec gives a value of ``shape``.

        Raises:
            ValueError: If an axis is out of range or a tile does not divide its
                axis.
        """
        shape = tuple(shape)
        ndim = len(shape)
        qtype = self.resolved_qtype
        channel = _axes("channelwise_axes", self.channelwise_axes, ndim)
        pairs = cast(tuple[tuple[int, int | float], ...], self.tiled_axes)  # see __post_init__
        tiled = _axes("tiled_axes", [a for a, _ in pairs], ndim, shown=dict(pairs))
        tiles = {a: t for a, (_, t) in zip(tiled, pairs, strict=True)}
        both = sorted(set(channel) & set(tiles))
        if both:
            raise ValueError(
                f"channelwise_axes={self.channelwise_axes} and tiled_axes={dict(pairs)} both "
                f"name axis {both[0]} of an array of rank {ndim}; an axis is one or the other"
            )
        if qtype.block_size is not None:
            if not tiles:
                # Blocks run along the innermost axis that shares scales (a weight's
                # innermost contracted axis), never along a per-channel one.
                reduced = [a for a in range(ndim) if a not in channel]
                if not reduced:
                    raise ValueError(
                        f"qtype={qtype.name!r} is block-scaled; it needs an axis that is not "
                        f"channelwise to run its blocks along (shape {shape}, channelwise_axes="
                        f"{self.channelwise_axes})"
                    )
                tiles = {reduced[-1]: qtype.block_size}
            if len(tiles) != 1 or next(iter(tiles.values())) != qtype.block_size:
                raise ValueError(
                    f"qtype={qtype.name!r} uses blocks of {qtype.block_size} along one axis; "
                    f"got tiled_axes={dict(self.tiled_axes)}"
                )
        out = []
        for i, d in enumerate(shape):
            if i in channel:
                out.append(d)
            elif i in tiles:
                t = tiles[i]
                t = round(d * t) if isinstance(t, float) else t
                if t <= 0 or d % t:
                    raise ValueError(
                        f"tiled_axes: tile {tiles[i]!r} of axis {i} must divide its size {d} "
                        f"(shape {shape}); allowed tiles are the divisors of {d}"
                    )
                out.append(d // t)
            else:
                out.append(1)
        return tuple(out)


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _int_arg(name: str, values: Any) -> list[int]:
    vals = list(values) if isinstance(values, Sequence | np.ndarray) else None
    if vals is None or not all(_is_int(v) for v in vals):
        raise ValueError(f"{name}={values!r} must be an int or a sequence of ints (axes)")
    return [int(v) for v in vals]


def _tile_pairs(tiled_axes: Any) -> tuple[tuple[int, int | float], ...]:
    """``tiled_axes`` (a mapping or ``(axis, tile)`` pairs) as sorted pairs, checked."""
    if isinstance(tiled_axes, Mapping):
        pairs = list(tiled_axes.items())
    elif isinstance(tiled_axes, Sequence) and all(
        isinstance(p, Sequence) and len(p) == 2 for p in tiled_axes
    ):
        pairs = [tuple(p) for p in tiled_axes]
    else:
        raise ValueError(
            f"tiled_axes={tiled_axes!r} must be a mapping {{axis: tile}} or a sequence of "
            "(axis, tile) pairs"
        )
    axes = _int_arg("tiled_axes", [a for a, _ in pairs]) if pairs else []
    if len(set(axes)) != len(axes):
        dup = next(a for a in axes if axes.count(a) > 1)
        raise ValueError(
            f"tiled_axes={tiled_axes!r} gives axis {dup} more than one tile; allowed: each "
            "axis once"
        )
    return tuple(sorted(zip(axes, (t for _, t in pairs), strict=True)))


def _axes(name: str, axes: Sequence[int], ndim: int, shown: Any = None) -> list[int]:
    """``axes`` normalised to ``0..ndim-1``; raises if one is out of range or repeated."""
    out = [_axis(name, a, ndim) for a in axes]
    for i, a in enumerate(out):
        if a in out[:i]:
            first = axes[out.index(a)]
            raise ValueError(
                f"{name}={tuple(axes) if shown is None else shown}: {first} and {axes[i]} name "
                f"the same axis {a} of an array of rank {ndim}; allowed: each axis once"
            )
    return out


# Scale dtypes that are not a block type's own (e8m0, e4m3): ops take the result dtype
# from them (see qcore.ops.operand), and QArray.astype casts them.
_FULL_PRECISION_SCALES = frozenset(
    jnp.dtype(d) for d in (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16)
)

_FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")


def _float_dtype(name: str, dtype: Any) -> np.dtype:
    """``dtype`` as a floating-point dtype; raises naming ``name`` otherwise."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(
            f"{name}={dtype!r} is not a floating-point dtype; allowed: {', '.join(_FLOAT_DTYPES)}"
        )
    return dt


def _check_how(how: Any) -> None:
    if not isinstance(how, HowToQuantize):
        raise TypeError(
            f"how={how!r} must be a HowToQuantize, e.g. HowToQuantize(qtype='int8'), "
            f"not a {type(how).__name__}"
        )


def _check_qarray(q: Any, name: str = "q") -> None:
    if not isinstance(q, QArray):
        raise TypeError(
            f"{name} must be a QArray, got {type(q).__name__}; quantize the array first "
            "with qcore.quantize(x, how)"
        )


def _concrete(a: Any) -> np.ndarray | None:
    """``a`` as a NumPy array, or None under tracing (inside ``jax.jit``)."""
    return None if isinstance(a, Tracer) else np.asarray(a)


def _check_scale_values(scale: Any, name: str = "scale", *, allow_nan: bool = False) -> None:
    """Raises if a concrete, caller-given scale is not finite and > 0 (NaN if ``allow_nan``)."""
    s = _concrete(scale)
    if s is None:
        return
    s32 = s.astype(np.float32)
    bad = ~(np.isfinite(s32) & (s32 > 0))
    if allow_nan:
        bad &= ~np.isnan(s32)
    if bad.any():
        nan = " or NaN (a block that held a non-finite value)" if allow_nan else ""
        raise ValueError(
            f"{name} has {int(bad.sum())} values that are not finite and > 0 (first: "
            f"{s.ravel()[np.argmax(bad.ravel())]}); allowed: finite scales > 0{nan}"
        )


def _check_codes(name: str, codes: Any, qtype: QType, lo: float, hi: float) -> None:
    """Raises if concrete ``codes`` are not integers in ``[lo, hi]``."""
    c = _concrete(codes)
    if c is None or c.size == 0:
        return
    c = c.astype(np.float64)
    bad = (c < lo) | (c > hi) | (c != np.round(c))  # NaN != NaN: bad too
    if qtype.kind == "binary":
        bad |= c == 0
    if bad.any():
        allowed = "-1 or 1" if qtype.kind == "binary" else f"integers in {lo:g}..{hi:g}"
        raise ValueError(
            f"{name} holds {int(bad.sum())} values that are not codes of qtype={qtype.name!r} "
            f"(first: {c.ravel()[np.argmax(bad.ravel())]:g}); allowed: {allowed}"
        )


def _axis(name: str, axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"{name}: axis {axis} is out of range for an array of rank {ndim}; "
            f"allowed: {-ndim}..{ndim - 1}"
        )
    return axis % ndim


@dataclasses.dataclass(frozen=True)
class Packing:
    """Static record of how codes are packed: along ``axis`` (negative), ``length`` codes."""

    axis: int
    length: int


class QArray:
    """Quantized codes, scales and static metadata (see the module docstring).

    Attributes:
        qvalue: Codes in ``qtype.storage_dtype``, or ``uint8`` bytes when packed.
        scale: Scale with the value's rank (generic broadcast rule).
        zero_point: Integer zero points (in the codes' storage dtype) shaped like
            ``scale``, or None.
        tensor_scale: Per-tensor float32 scale (nvfp4), shaped ``(1,) * ndim``,
            or None.
        qtype: The quantization type (static).
        dtype: The dtype :func:`dequantize` returns (static).
        packing: How ``qvalue`` is packed, or None (static).

    Constructing one checks the arguments: ``qvalue`` in the qtype's storage
    dtype, a floating-point ``scale`` and ``dtype``, shapes that fit and, when the
    values are concrete (not under ``jax.jit``), codes and zero points inside the
    qtype's range and scales that are finite and > 0; a violation is a ValueError
    naming the argument, the bad value and the allowed range. A ``NaN`` scale is
    allowed (a block that held a non-finite value).
    """

    __slots__ = ("qvalue", "scale", "zero_point", "tensor_scale", "qtype", "dtype", "packing")

    qvalue: jax.Array
    scale: jax.Array
    zero_point: jax.Array | None
    tensor_scale: jax.Array | None
    qtype: QType
    dtype: np.dtype
    packing: Packing | None

    def __init__(
        self,
        qvalue: jax.Array,
        scale: jax.Array,
        zero_point: jax.Array | None = None,
        *,
        qtype: QType | str,
        dtype: Any = None,
        tensor_scale: jax.Array | None = None,
        packing: Packing | None = None,
    ) -> None:
        qtype = qtypes.get(qtype)
        qvalue, scale = jnp.asarray(qvalue), jnp.asarray(scale)
        _check_float(scale, "scale")
        _check_scale_values(scale, allow_nan=True)
        if tensor_scale is not None:
            _check_scale_values(tensor_scale, "tensor_scale", allow_nan=True)
        dtype = _float_dtype("dtype", dtype if dtype is not None else scale.dtype)
        expected = jnp.dtype(jnp.uint8) if packing is not None else qtype.storage_dtype
        if qvalue.dtype != expected:
            raise ValueError(
                f"qvalue has dtype {qvalue.dtype}; qtype={qtype.name!r} stores its "
                f"{'packed ' if packing is not None else ''}codes as {expected}"
            )
        if packing is None and qtype.kind != "float":  # every packed bit pattern is a code
            hi = len(qtype.codebook) - 1 if qtype.codebook else qtype.qmax
            _check_codes("qvalue", qvalue, qtype, 0 if qtype.codebook else qtype.qmin, hi)
        if zero_point is not None:
            _check_zero_point_allowed(qtype)
            zero_point = jnp.asarray(zero_point)
            _check_codes("zero_point", zero_point, qtype, qtype.qmin, qtype.qmax)
        _set(self, qvalue, scale, zero_point, tensor_scale, qtype, dtype, packing)
        _check_scale_shape(self.shape, scale.shape, "scale")
        if zero_point is not None:
            _check_zero_point_shape(jnp.shape(zero_point), scale.shape)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"QArray is immutable; cannot set {name!r}")

    # -- shape-like protocol --------------------------------------------------
    @property
    def shape(self) -> Shape:
        """The logical (unpacked) shape."""
        shape = list(self.qvalue.shape)
        if self.packing is not None:
            shape[self.packing.axis] = self.packing.length
        return tuple(shape)

    @property
    def ndim(self) -> int:
        """Rank of the value."""
        return self.qvalue.ndim

    @property
    def size(self) -> int:
        """Number of logical elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held by codes, scales and zero points (as stored)."""
        return sum(leaf.nbytes for leaf in jax.tree.leaves(self))

    @property
    def scale_tile_shape(self) -> Shape:
        """How many values share one scale along each axis (``shape // scale.shape``)."""
        return _tile_shape(self.shape, self.scale.shape)

    @property
    def zero_point_tile_shape(self) -> Shape | None:
        """Like :attr:`scale_tile_shape` for the zero points; None when symmetric."""
        return None if self.zero_point is None else _tile_shape(self.shape, self.zero_point.shape)

    @property
    def T(self) -> QArray:  # noqa: N802 - mirrors jax.Array.T
        """Transpose with all axes reversed."""
        return self.transpose()

    @property
    def mT(self) -> QArray:  # noqa: N802 - mirrors jax.Array.mT
        """Matrix transpose: the last two axes swapped."""
        if self.ndim < 2:
            raise ValueError(f"mT needs a QArray of rank >= 2, got shape {self.shape}")
        return self.swapaxes(-2, -1)

    def swapaxes(self, axis1: int, axis2: int) -> QArray:
        """Swaps two axes of codes, scales and zero points together."""
        perm = list(range(self.ndim))
        a, b = _axis("axis1", axis1, self.ndim), _axis("axis2", axis2, self.ndim)
        perm[a], perm[b] = b, a
        return self.transpose(*perm)

    def astype(self, dtype: Any) -> QArray:
        """The same codes, dequantizing to ``dtype`` (a floating-point dtype).

        Ops take their result dtype from a QArray's scale, so a scale in float32,
        bfloat16 or float16 is cast (rounded to nearest) to ``dtype`` too; a block
        scale (e8m0, e4m3) keeps its own dtype.

        Raises:
            ValueError: If ``dtype`` is not a floating-point dtype.

        Example:
            >>> import jax.numpy as jnp
            >>> from qcore import HowToQuantize, quantize
            >>> q = quantize(jnp.linspace(-1.0, 1.0, 8), HowToQuantize(qtype="int8"))
            >>> q16 = q.astype("bfloat16")
            >>> q16.dtype, q16.scale.dtype
            (dtype(bfloat16), dtype(bfloat16))
        """
        dtype = _float_dtype("dtype", dtype)
        scale = self.scale
        if scale.dtype in _FULL_PRECISION_SCALES:
            scale = scale.astype(dtype)
        return QArray._from_parts(
            self.qvalue, scale, self.zero_point, self.tensor_scale, self.qtype, dtype, self.packing
        )

    def transpose(self, *axes: int) -> QArray:
        """Permutes axes of codes, scales and zero points together."""
        perm = tuple(axes[0]) if len(axes) == 1 and not isinstance(axes[0], int) else axes
        perm = tuple(perm) if perm else tuple(reversed(range(self.ndim)))
        if sorted(a % self.ndim for a in perm) != list(range(self.ndim)):
            raise ValueError(f"axes={perm} is not a permutation of range({self.ndim})")
        perm = tuple(a % self.ndim for a in perm)
        packing = self.packing
        if packing is not None:
            packing = Packing(perm.index(packing.axis % self.ndim) - self.ndim, packing.length)
        return self._replace(lambda a: jnp.transpose(a, perm), packing=packing)

    def reshape(self, *shape: int | Sequence[int]) -> QArray:
        """Reshapes when every scale tile maps onto the new shape.

        Merging axes works when, inside each merged group, per-channel axes come
        before at most one tiled axis and reduced axes come last; splitting an
        axis works when its tiles stay whole. Anything else raises ValueError.
        """
        if self.packing is not None:
            raise ValueError("reshape of a packed QArray: call qcore.unpack(q) first")
        new = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        new = _resolve_shape(self.shape, tuple(int(d) for d in new))  # type: ignore[arg-type]
        new_scale = _reshape_scale(self.shape, self.scale.shape, new)
        result = self._replace(lambda a: a.reshape(new_scale), qvalue=self.qvalue.reshape(new))
        return result

    def __getitem__(self, index: Any) -> QArray:
        """Indexes with ints, slices, ``None`` and ``...``; slices of tiled axes keep tiles whole.

        ``None`` (``np.newaxis``) inserts a size-1 axis, as for arrays.
        """
        if self.packing is not None:
            raise ValueError("indexing a packed QArray: call qcore.unpack(q) first")
        idx = index if isinstance(index, tuple) else (index,)
        used = sum(i is not None and i is not Ellipsis for i in idx)
        if idx.count(Ellipsis) == 1:
            at = idx.index(Ellipsis)
            idx = idx[:at] + (slice(None),) * (self.ndim - used) + idx[at + 1 :]
        if used > self.ndim or not all(i is None or isinstance(i, int | slice) for i in idx):
            raise ValueError(
                f"index {index!r}: QArray supports up to {self.ndim} ints and slices, "
                "None and one Ellipsis"
            )
        if None in idx:
            # Index without the Nones, then insert a size-1 axis where each stood in the result.
            kept = tuple(i for i in idx if i is not None)
            new_axes, out = [], 0
            for i in idx:
                if i is None:
                    new_axes.append(out)
                out += not isinstance(i, int)
            return self[kept]._replace(lambda a: jnp.expand_dims(a, new_axes))
        idx = idx + (slice(None),) * (self.ndim - len(idx))
        sidx = tuple(
            _scale_index(i, d, s, axis)
            for axis, (i, d, s) in enumerate(zip(idx, self.shape, self.scale.shape, strict=True))
        )
        tensor_scale = self.tensor_scale
        if tensor_scale is not None:
            tensor_scale = tensor_scale.reshape((1,) * sum(isinstance(i, slice) for i in idx))
        return QArray._from_parts(
            self.qvalue[idx],
            self.scale[sidx],
            None if self.zero_point is None else self.zero_point[sidx],
            tensor_scale,
            self.qtype,
            self.dtype,
            None,
        )

    def __repr__(self) -> str:
        extra = "" if self.zero_point is None else ", asymmetric"
        extra += "" if self.packing is None else f", packed along {self.packing.axis}"
        return (
            f"QArray({self.qtype.name}, shape={self.shape}, dtype={self.dtype.name}, "
            f"scale={tuple(self.scale.shape)}{extra})"
        )

    # -- internals ---------------------------------------------------------------
    @classmethod
    def _from_parts(cls, qvalue, scale, zero_point, tensor_scale, qtype, dtype, packing):
        obj = object.__new__(cls)
        _set(obj, qvalue, scale, zero_point, tensor_scale, qtype, dtype, packing)
        return obj

    def _replace(self, fn, *, qvalue=None, packing: Any = "same") -> QArray:
        zp, ts = self.zero_point, self.tensor_scale
        qvalue = fn(self.qvalue) if qvalue is None else qvalue
        return QArray._from_parts(
            qvalue,
            fn(self.scale),
            None if zp is None else fn(zp),
            None if ts is None else ts.reshape((1,) * qvalue.ndim),
            self.qtype,
            self.dtype,
            self.packing if packing == "same" else packing,
        )

    def tree_flatten_with_keys(self):  # noqa: D102 - pytree protocol
        keys = ("qvalue", "scale", "zero_point", "tensor_scale")
        children = tuple((jax.tree_util.GetAttrKey(k), getattr(self, k)) for k in keys)
        return children, (self.qtype, self.dtype, self.packing)

    @classmethod
    def tree_unflatten(cls, aux, children):  # noqa: D102 - pytree protocol
        # Bypasses __init__: JAX rebuilds pytrees with tracers or placeholders.
        return cls._from_parts(*children, *aux)


jax.tree_util.register_pytree_with_keys_class(QArray)


def _set(obj, qvalue, scale, zero_point, tensor_scale, qtype, dtype, packing) -> None:
    for name, value in zip(
        QArray.__slots__,
        (qvalue, scale, zero_point, tensor_scale, qtype, dtype, packing),
        strict=True,
    ):
        object.__setattr__(obj, name, value)


def _check_scale_shape(shape: Shape, sshape: Shape, name: str) -> None:
    ok = len(sshape) == len(shape) and all(
        s > 0 and d % s == 0 for s, d in zip(sshape, shape, strict=True)
    )
    if not ok and not (0 in shape and len(sshape) == len(shape)):
        raise ValueError(
            f"{name} shape {tuple(sshape)} does not fit value shape {tuple(shape)}: it needs the "
            "same rank and each of its dims must divide the value's dim"
        )


def _tile_shape(shape: Shape, sshape: Shape) -> Shape:
    return tuple(d // s if s else d for d, s in zip(shape, sshape, strict=True))


def _check_zero_point_allowed(qtype: QType) -> None:
    if not qtype.supports_asymmetric:
        raise ValueError(
            f"zero_point given but qtype={qtype.name!r} (kind {qtype.kind!r}) cannot "
            "hold a zero point; allowed: uniform integer qtypes"
        )


def _check_zero_point_shape(zshape: Shape, sshape: Shape) -> None:
    if tuple(zshape) != tuple(sshape):
        raise ValueError(
            f"zero_point shape {tuple(zshape)} does not fit: zero points need the scale's "
            f"shape {tuple(sshape)}"
        )


def _scale_index(i: int | slice, d: int, s: int, axis: int) -> int | slice:
    tile = d // s if s else 1
    if isinstance(i, int):
        if not -d <= i < d:
            raise IndexError(f"index {i} is out of bounds for axis {axis} with size {d}")
        return (i % d) // tile
    if s == 1:
        return slice(None)
    start, stop, step = i.indices(d)
    if tile == 1:
        return slice(start, stop, step)
    if step != 1 or start % tile or (stop % tile and stop != d):
        raise ValueError(
            f"slice {i} along axis {axis} cuts its tiles of {tile}; slices along a tiled axis "
            "must start and stop on tile boundaries with step 1"
        )
    return slice(start // tile, -(-stop // tile))


def _resolve_shape(old: Shape, new: Shape) -> Shape:
    size = math.prod(old)
    if new.count(-1) > 1:
        raise ValueError(f"shape {new}: at most one -1")
    if -1 in new:
        rest = math.prod(d for d in new if d != -1)
        new = tuple(size // rest if d == -1 and rest else d for d in new)
    if math.prod(new) != size:
        raise ValueError(f"cannot reshape a QArray of shape {old} into {new}")
    return new


def _reshape_scale(old: Shape, sold: Shape, new: Shape) -> Shape:
    """The scale shape after reshaping the value from ``old`` to ``new``."""
    out: list[int] = []
    i = j = 0
    while i < len(old) or j < len(new):
        # Collect the smallest groups of old and new axes with equal products.
        gi, gj = [i], [j]
        pi = old[i] if i < len(old) else 1
        pj = new[j] if j < len(new) else 1
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                pi *= old[i]
                gi.append(i)
                i += 1
            else:
                pj *= new[j]
                gj.append(j)
                j += 1
        gi = [a for a in gi if a < len(old)]
        gj = [a for a in gj if a < len(new)]
        # Merge the old group into one axis whose scales each cover ``tile`` elements.
        # Inner reduced axes and the first scaled axis make up the tile; every axis
        # outside that one must be per-channel.
        tile, outer = 1, False
        for a in reversed(gi):
            d, s = old[a], sold[a]
            if d == 1:
                continue
            if outer and s != d:
                raise _reshape_error(old, sold, new)
            if not outer:
                tile *= d // s
                outer = s != 1
        # Split it into the new group's axes, innermost first: an axis inside one
        # tile shares a scale (1), an axis holding whole tiles has d // tile, and
        # once the tile is used up every further axis is per-channel.
        part: list[int] = []
        for b in reversed(gj):
            d = new[b]
            if tile % d == 0:
                part.append(1)
                tile //= d
            elif tile > 1 and d % tile == 0:
                part.append(d // tile)
                tile = 1
            elif tile == 1:
                part.append(d)
            else:
                raise _reshape_error(old, sold, new)
        out.extend(reversed(part))
    return tuple(out)


def _reshape_error(old: Shape, sold: Shape, new: Shape) -> ValueError:
    return ValueError(
        f"cannot reshape a QArray of shape {old} with scale shape {sold} into {new}: the "
        "scale tiles would not map onto the new shape; dequantize first or keep tiles whole"
    )


# -- quantize / dequantize --------------------------------------------------------


def _blocks(shape: Shape, sshape: Shape) -> Shape:
    """Interleaved (scale dim, tile) shape: a value viewed block by block."""
    return tuple(v for s, d in zip(sshape, shape, strict=True) for v in (s, d // s if s else 0))


def _compact(shape: Shape, sshape: Shape) -> tuple[Shape, list[int]]:
    """The block view of :func:`_blocks` and the positions of its non-1 dims.

    Viewing values without the size-1 dims (a per-channel scale's tile of 1, a
    per-tensor scale's single block) changes no value, but XLA:CPU reduced and
    encoded the interleaved 4-d view of a per-channel matrix (innermost dim 1)
    ~10x slower than the plain 2-d one.
    """
    blocks = _blocks(shape, sshape)
    keep = [i for i, n in enumerate(blocks) if n != 1]
    if 0 in blocks or not any(i % 2 for i in keep):  # nothing left to reduce
        keep = list(range(len(blocks)))
    return blocks, keep


def _calibration_view(x: jax.Array, sshape: Shape) -> tuple[jax.Array, tuple[int, ...]]:
    """``x`` viewed block by block (see :func:`_compact`) and the axes to reduce."""
    blocks, keep = _compact(x.shape, sshape)
    axes = tuple(k for k, i in enumerate(keep) if i % 2)
    return x.reshape(tuple(blocks[i] for i in keep)), axes


def _apply(x: jax.Array, fn, *scales: jax.Array | None) -> jax.Array:
    """``fn(x_blocks, *scale_blocks)`` reshaped back to ``x``'s shape.

    The scale blocks broadcast against the value blocks (a size-1 dim per tile).
    """
    sshape = next(s.shape for s in scales if s is not None)
    blocks, keep = _compact(x.shape, sshape)
    xb = x.reshape(tuple(blocks[i] for i in keep))

    def per_block(a: jax.Array) -> jax.Array:
        view = tuple(v for n in a.shape for v in (n, 1))
        return a.reshape(tuple(view[i] for i in keep))

    out = fn(xb, *(None if s is None else per_block(s) for s in scales))
    return out.reshape(x.shape)


def _cast_scale_up(scale: jax.Array, dtype: Any) -> jax.Array:
    """Casts scales, rounding up so the calibrated bound stays representable.

    A scale below the dtype's smallest normal value is raised to it (the block's
    values then still fit the code range); ``NaN`` stays ``NaN``, and a scale
    above the dtype's range becomes ``inf`` (or ``NaN`` in dtypes without
    ``inf``), never a finite stand-in.
    """
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return scale
    low = scale.astype(dtype)
    # Towards the largest finite value: e4m3fn has no inf, nextafter(x, inf) is NaN.
    up = jnp.nextafter(low, jnp.array(jnp.finfo(dtype).max, dtype))
    out = jnp.where(low.astype(jnp.float32) < scale, up, low)
    tiny = jnp.array(jnp.finfo(dtype).tiny, dtype)
    return jnp.where(out.astype(jnp.float32) < tiny.astype(jnp.float32), tiny, out)


def _check_float(x: jax.Array, name: str = "x") -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"{name} must be a floating-point array, got dtype {x.dtype}; allowed: "
            f"{', '.join(_FLOAT_DTYPES[:3])}"
        )


def calibrate(
    x: jax.Array, how: HowToQuantize
) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array, jax.Array]:
    """Computes the stored quantization parameters of ``x`` under ``how``.

    Returns:
        ``(scale, zero_point, tensor_scale, lo, hi)``: the scale in its stored
        dtype, zero points in the codes' dtype or None, the nvfp4 per-tensor
        scale or None, and the float32 calibrated range ends, all shaped
        ``how.scale_shape(x.shape)``. A block holding ``NaN`` or ``±inf`` has
        ``NaN`` range ends and scale (its zero point is stored as 0).

    Raises:
        TypeError: If ``how`` is not a :class:`HowToQuantize`.
        ValueError: For a non-float ``x`` or axes and tiles that do not fit it.
    """
    _check_how(how)
    x = jnp.asarray(x)
    _check_float(x)
    how.scale_shape(x.shape)  # raises on bad axes or tiles before tracing
    return _calibrate(x, how)


# Every entry point runs one compiled computation, so calling it eagerly gives
# bit-identical results to calling it inside ``jax.jit`` (op-by-op dispatch
# rounds some divisions differently from a fused kernel).
@partial(jax.jit, static_argnames=("how",))
def _calibrate(x: jax.Array, how: HowToQuantize):
    qtype = how.resolved_qtype
    sshape = how.scale_shape(x.shape)
    x = _exact_input(x)
    xb, axes = _calibration_view(x.astype(jnp.float32), sshape)
    calibrator = calibration_lib.parse(how.calibration)
    bound = getattr(calibrator, "bound", None)
    if how.symmetric and bound is not None:
        # A calibrator with a ``bound`` (absmax: the common case, dynamic activations
        # included) gives it directly, in fewer ops than scale_from_range recomputing
        # it from ``(-bound, bound)``; a model has one per quantized op and XLA's
        # compile time grows with them.
        hi = bound(xb, axes).reshape(sshape)
        lo, zero_point = -hi, None
        scale = numerics.scale_from_bound(hi, qtype, how.narrow_range)
    else:
        lo, hi = calibrator(
            xb, axes, qtype=qtype, symmetric=how.symmetric, narrow_range=how.narrow_range
        )
        lo, hi = lo.reshape(sshape), hi.reshape(sshape)
        if not isinstance(calibrator, calibration_lib.BUILTINS):
            # Built-ins give non-finite blocks a NaN range themselves (see calibration).
            finite = _block_all_finite(x, sshape)
            lo, hi = (jnp.where(finite, jnp.asarray(r, jnp.float32), jnp.nan) for r in (lo, hi))
        scale, zero_point = numerics.scale_from_range(
            lo, hi, qtype, symmetric=how.symmetric, narrow_range=how.narrow_range
        )
    if zero_point is not None:
        # Integral and within the code range, so the codes' dtype holds it exactly; a
        # non-finite block's NaN zero point is stored as 0 (its NaN scale remains).
        zero_point = jnp.where(jnp.isnan(zero_point), 0.0, zero_point)
        zero_point = zero_point.astype(qtype.storage_dtype)
    tensor_scale = None
    if qtype.tensor_scale:
        # nvfp4: a float32 per-tensor scale keeps every block scale inside e4m3's
        # range [2**-9, 448] (NVIDIA's two-level scheme). Only blocks with finite,
        # non-zero values take part: a NaN block keeps its NaN scale, an all-zero
        # block gets block scale 1 (its codes are 0), so neither moves the others.
        e4m3_max = float(jnp.finfo(jnp.float8_e4m3fn).max)
        empty = jnp.maximum(jnp.abs(lo), jnp.abs(hi)) == 0
        live = jnp.where(empty | jnp.isnan(scale), 0.0, scale)
        tensor_scale = jnp.max(live, keepdims=True).reshape((1,) * x.ndim) / e4m3_max
        tensor_scale = jnp.where(tensor_scale > 0, tensor_scale, 1.0)
        scale = jnp.where(empty, tensor_scale, scale) / tensor_scale
    if qtype.scale_dtype == "float8_e4m3fn":
        # nvfp4 block scales round to nearest (NVIDIA's recipe): rounding them up
        # as below raised the N(0,1) error from 0.089 to 0.095. A block far below
        # the tensor's maximum would underflow to 0: give it e4m3's smallest step.
        s8 = scale.astype(jnp.float8_e4m3fn)
        tiny = jnp.array(2.0**-9, jnp.float8_e4m3fn)
        s8 = jnp.where((s8 > 0) | jnp.isnan(s8), s8, tiny)
        return s8, zero_point, tensor_scale, lo, hi
    scale_dtype = qtype.scale_dtype or how.scale_dtype or x.dtype
    return _cast_scale_up(scale, scale_dtype), zero_point, tensor_scale, lo, hi


def quantize(x: jax.Array, how: HowToQuantize, *, key: jax.Array | None = None) -> QArray:
    """Quantizes ``x``: calibrates scales per ``how``, then encodes.

    Args:
        x: A floating-point array.
        how: The spec.
        key: PRNG key, required for stochastic rounding.

    Returns:
        A :class:`QArray` whose ``dequantize`` has ``x``'s dtype.

    A block (the values sharing one scale) that holds a ``NaN`` or ``±inf`` gets a
    ``NaN`` scale, so it dequantizes to ``NaN`` (see :mod:`qcore.numerics`).

    Raises:
        TypeError: If ``how`` is not a :class:`HowToQuantize`.
        ValueError: For bad axes or tiles, non-float ``x`` or a missing key.

    Example:
        >>> import jax.numpy as jnp
        >>> dequantize(quantize(jnp.array([jnp.nan, 1.0, -2.0]), HowToQuantize(qtype="int8")))
        Array([nan, nan, nan], dtype=float32)
    """
    _check_how(how)
    x = jnp.asarray(x)
    _check_float(x)
    how.scale_shape(x.shape)
    if how.pack:
        _axis("pack_axis", how.pack_axis, x.ndim)
    return _quantize(x, how, key)


def _exact_input(x: jax.Array) -> jax.Array:
    """``x`` with the values of its own dtype, also under ``jax.jit``.

    XLA allows excess precision: a bf16 value computed in float32 and cast to bf16
    (a bf16 initializer, a bf16 layer's output) may reach the float32 arithmetic
    here without the cast's rounding. A bf16 model's jitted init then quantized
    other values than its eager init and ``quantize_params`` (16 % of the codes
    differed; issue 20). The barrier keeps the rounding; float32 inputs skip it.
    Calibration and encoding both start here.
    """
    if jnp.dtype(x.dtype).itemsize >= 4:
        return x
    return jax.lax.optimization_barrier(x)


@partial(jax.jit, static_argnames=("how",))
def _quantize(x: jax.Array, how: HowToQuantize, key: jax.Array | None) -> QArray:
    scale, zero_point, tensor_scale, _, _ = _calibrate(x, how)
    qtype = how.resolved_qtype
    q = _encode(x, scale, zero_point, tensor_scale, key, qtype, how.rounding, how.narrow_range)
    return pack(q, axis=how.pack_axis) if how.pack else q


def quantize_with_scale_zero_point(
    x: jax.Array,
    qtype: QType | str,
    scale: jax.Array,
    zero_point: jax.Array | None = None,
    *,
    tensor_scale: jax.Array | None = None,
    rounding: str = "nearest_even",
    narrow_range: bool = False,
    key: jax.Array | None = None,
) -> QArray:
    """Encodes ``x`` with given scales (and zero points), e.g. stored static ranges.

    Args:
        x: A floating-point array.
        qtype: Target type.
        scale: Scales following the generic broadcast rule for ``x``'s shape.
        zero_point: Integral zero points in the code range, shaped like ``scale``
            (uniform integer types only), or None; stored in the codes' dtype.
            Under ``jax.jit`` (values not concrete) they are rounded and clipped
            to the code range instead of checked.
        tensor_scale: Per-tensor scale multiplying ``scale`` (nvfp4), or None.
        rounding: See :func:`qcore.numerics.round_values`.
        narrow_range: See :func:`qcore.numerics.int_range`.
        key: PRNG key for stochastic rounding.

    Returns:
        The QArray. A block (the values sharing one of the given scales) that
        holds a ``NaN`` or ``±inf`` gets a ``NaN`` scale in it, so it dequantizes
        to ``NaN``; this costs one ``isfinite`` reduction over ``x``.

    Raises:
        ValueError: For a non-float ``x`` or scale, shapes that do not fit, a zero
            point the qtype cannot hold, or (when the values are concrete, not
            under ``jax.jit``) a scale or tensor scale that is not finite and > 0,
            or a zero point that is not an integer in the code range.

    Example:
        >>> import jax.numpy as jnp
        >>> q = quantize_with_scale_zero_point(
        ...     jnp.array([0.0, 0.25, 1.0, 2.0]), "uint8", jnp.array([1 / 255])
        ... )
        >>> q.qvalue
        Array([  0,  64, 255, 255], dtype=uint8)
        >>> quantize_with_scale_zero_point(jnp.ones(2), "int8", jnp.array([0.0]))
        Traceback (most recent call last):
        ...
        ValueError: scale has 1 values that are not finite and > 0 (first: 0.0); allowed: ...
    """
    x = jnp.asarray(x)
    _check_float(x)
    qtype = qtypes.get(qtype)
    numerics.check_rounding(rounding, qtype)
    scale = jnp.asarray(scale)
    _check_float(scale, "scale")
    _check_scale_shape(x.shape, scale.shape, "scale")
    _check_scale_values(scale)
    if tensor_scale is not None:
        tensor_scale = jnp.asarray(tensor_scale)
        _check_float(tensor_scale, "tensor_scale")
        _check_scale_values(tensor_scale, "tensor_scale")
    if zero_point is not None:
        _check_zero_point_allowed(qtype)
        zero_point = jnp.asarray(zero_point)
        _check_zero_point_shape(zero_point.shape, scale.shape)
        qmin, qmax = numerics.int_range(qtype, narrow_range)
        _check_codes("zero_point", zero_point, qtype, qmin, qmax)
        zp32 = jnp.round(zero_point.astype(jnp.float32))  # exact for every int dtype here
        zero_point = jnp.clip(zp32, qmin, qmax).astype(qtype.storage_dtype)
    return _encode(
        x, scale, zero_point, tensor_scale, key, qtype, rounding, narrow_range, mark_non_finite=True
    )


def _largest_element(qtype: QType, scale: jax.Array) -> jax.Array:
    """The largest element of a float qtype whose value times ``scale`` stays finite.

    Only a block whose values come within one element step of float32's maximum
    needs it: a power-of-two (e8m0) scale rounded up could otherwise let
    ``256 · 2**120`` overflow to ``inf``.
    """
    limit = jnp.minimum(numerics._MAX / scale, qtype.qmax)
    element = limit.astype(qtype.storage_dtype)
    down = jnp.nextafter(element, jnp.zeros_like(element))
    element = jnp.where(element.astype(jnp.float32) > limit, down, element)
    return element.astype(jnp.float32)


def _block_all_finite(x: jax.Array, sshape: Shape) -> jax.Array:
    """Whether each block of ``x`` (one per scale, shaped ``sshape``) is all finite."""
    xb, axes = _calibration_view(x, sshape)
    return calibration_lib._all_finite(xb, axes).reshape(sshape)


@partial(jax.jit, static_argnums=(5, 6, 7), static_argnames=("mark_non_finite",))
def _encode(
    x, scale, zero_point, tensor_scale, key, qtype, rounding, narrow_range, mark_non_finite=False
) -> QArray:
    """Encodes ``x`` with stored scales.

    ``mark_non_finite`` gives blocks holding a non-finite value a NaN scale
    (calibrated scales are NaN there already).
    """
    x = _exact_input(x)
    s32 = scale.astype(jnp.float32)
    if tensor_scale is not None:
        s32 = s32 * tensor_scale.astype(jnp.float32)

    def enc(xb, sb, zb, huge):
        # Scales above 2**64 (values near float32's maximum) need an exact division
        # and, for float kinds, elements whose value stays finite; the common case
        # skips both (a per-element multiply and clip cost ~20% of the speed).
        v = numerics.divide(xb, sb) if huge else xb.astype(jnp.float32) / sb
        if zb is not None:
            v = v + zb.astype(jnp.float32)
        if huge and qtype.kind == "float":
            v = jnp.clip(v, -_largest_element(qtype, sb), _largest_element(qtype, sb))
        return numerics.encode(v, qtype, rounding=rounding, narrow_range=narrow_range, key=key)

    if qtype.kind == "int":
        # Integer codes need no clip: the exact division alone handles huge scales, and
        # equals the plain one below 2**64 (its factor is 1). No ``lax.cond`` then: two
        # compiled branches per quantize made a w8a8 model's XLA compile ~1.6x slower.
        codes = _apply(x, partial(enc, huge=True), s32, zero_point)
    else:
        codes = jax.lax.cond(
            jnp.any(s32 > 2.0**64),
            lambda: _apply(x, partial(enc, huge=True), s32, zero_point),
            lambda: _apply(x, partial(enc, huge=False), s32, zero_point),
        )
    if mark_non_finite:
        scale = jnp.where(_block_all_finite(x, scale.shape), scale, jnp.nan).astype(scale.dtype)
    return QArray._from_parts(
        codes, scale, zero_point, tensor_scale, qtype, jnp.dtype(x.dtype), None
    )


def dequantize(q: QArray, dtype: Any = None) -> jax.Array:
    """Returns ``(decode(codes) - zero_point) * scale`` in ``dtype`` (default ``q.dtype``).

    The arithmetic is float32; the result is cast once at the end. A block with a
    ``NaN`` scale (it held a non-finite value) dequantizes to ``NaN``.

    Raises:
        TypeError: If ``q`` is not a :class:`QArray`.
        ValueError: If ``dtype`` is not a floating-point dtype.
    """
    _check_qarray(q)
    return _dequantize(q, q.dtype if dtype is None else _float_dtype("dtype", dtype))


@partial(jax.jit, static_argnums=(1,))
def _dequantize(q: QArray, dtype: np.dtype) -> jax.Array:
    if q.packing is not None:
        q = unpack(q)
    s32 = q.scale.astype(jnp.float32)
    if q.tensor_scale is not None:
        s32 = s32 * q.tensor_scale.astype(jnp.float32)

    def dec(cb, sb, zb):
        v = numerics.decode(cb, q.qtype)
        if zb is not None:
            v = v - zb.astype(jnp.float32)
        return v * sb

    return _apply(q.qvalue, dec, s32, q.zero_point).astype(dtype)


def requantize(q: QArray, how: HowToQuantize, *, key: jax.Array | None = None) -> QArray:
    """Re-quantizes a QArray under another spec (e.g. int8 → int4, or new tiles)."""
    _check_qarray(q)
    return quantize(dequantize(q), how, key=key)


# -- packing ---------------------------------------------------------------------------


def _codes_for_packing(q: QArray) -> jax.Array:
    if q.qtype.kind == "binary":
        return (q.qvalue > 0).astype(jnp.uint8)
    if q.qtype.kind == "float":
        # 4-bit float elements are packed as their bit patterns.
        return jax.lax.bitcast_convert_type(q.qvalue, jnp.uint4).astype(jnp.uint8)
    return q.qvalue


def pack(q: QArray, *, axis: int = -1) -> QArray:
    """Packs the codes of a sub-byte QArray into ``uint8`` along ``axis``.

    Example:
        >>> import jax.numpy as jnp
        >>> from qcore import HowToQuantize, quantize
        >>> q = quantize(jnp.ones((4, 64)), HowToQuantize(qtype="int4"))
        >>> pack(q).qvalue.nbytes, q.qvalue.nbytes
        (128, 256)
    """
    _check_qarray(q)
    if q.packing is not None:
        return q
    if not q.qtype.packable:
        raise ValueError(f"qtype={q.qtype.name!r} has no sub-byte codes to pack")
    a = _axis("axis", axis, q.ndim)
    packed = packing.pack(_codes_for_packing(q), q.qtype.bits, axis=a)
    info = Packing(a - q.ndim, q.shape[a])
    return QArray._from_parts(packed, q.scale, q.zero_point, q.tensor_scale, q.qtype, q.dtype, info)


def unpack(q: QArray) -> QArray:
    """Inverse of :func:`pack` (a no-op on unpacked QArrays)."""
    _check_qarray(q)
    if q.packing is None:
        return q
    qtype = q.qtype
    signed = qtype.kind == "int" and qtype.signed
    codes = packing.unpack(
        q.qvalue, qtype.bits, q.packing.length, axis=q.packing.axis, signed=signed
    )
    return QArray._from_parts(
        storage_codes(codes, qtype), q.scale, q.zero_point, q.tensor_scale, qtype, q.dtype, None
    )


def storage_codes(codes: jax.Array, qtype: QType) -> jax.Array:
    """Unpacked codes (:func:`qcore.packing.unpack`) in ``qtype``'s storage dtype."""
    if qtype.kind == "float":  # 4-bit float elements were packed as their bit patterns
        return jax.lax.bitcast_convert_type(codes.astype(jnp.uint4), qtype.storage_dtype)
    if qtype.kind == "binary":
        return jnp.where(codes == 0, -1, 1).astype(qtype.storage_dtype)
    return codes.astype(qtype.storage_dtype)
