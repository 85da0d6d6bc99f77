"""Calibration: choosing the range ``[lo, hi]`` that a scale must cover.

A calibrator is a callable ``calibrator(x, axes, *, qtype, symmetric,
narrow_range) -> (lo, hi)`` that reduces ``x`` over ``axes`` (keeping them as
size-1 dims) and returns float32 range ends. A block (the values reduced into one
range) that holds a ``NaN`` or ``±inf`` gets ``lo = hi = NaN``, so its scale is
``NaN`` and it dequantizes to ``NaN`` (the NaN/Inf policy of ``docs/concepts.md``);
finite blocks get finite ranges, also for values near float32's maximum.
:func:`qcore.calibrate` applies the same rule to the result of a calibrator that
is not one of the built-ins. Built-ins are frozen dataclasses, so they are
hashable and can sit inside static quantization specs.

Strings are parsed only at the edges by :func:`parse`::

    "absmax"          AbsMax()             max |x|
    "absmax,0.9"      AbsMax(clip=0.9)     0.9 · max |x|
    "minmax"          MinMax()             [min(x, 0), max(x, 0)]
    "rms,7"           Rms(k=7)             ±7 · sqrt(mean(x²))
    "fixed,-6,6"      Fixed(-6, 6)         a constant range
    "fixed,6"         Fixed(-6, 6)         the same (Qwix's short form)
    "percentile,99.9" Percentile(99.9)     99.9th percentile of |x| (symmetric)
                                           or the 0.1th/99.9th of x (asymmetric)
    "mse"             Mse()                the clipping ratio of the absmax (or
                                           minmax) range that minimises the
                                           squared quantization error, per block
    "mse,64,0.1"      Mse(64, 0.1)         64 ratios searched in [0.1, 1]

Example:
    >>> import jax.numpy as jnp
    >>> from qcore import calibration, qtypes
    >>> x = jnp.array([[-4.0, 1.0], [2.0, jnp.inf]])
    >>> lo, hi = parse("absmax,0.5")(x, (1,), qtype=qtypes.get("int8"), symmetric=True)
    >>> hi.ravel().tolist()
    [2.0, nan]
    >>> parse("percentile,101")
    Traceback (most recent call last):
    ...
    ValueError: calibration='percentile,101': q=101.0 must be in (0, 100]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp

from qcore import numerics
from qcore.qtypes import QType

Axes = Sequence[int]


class Calibrator(Protocol):
    """The calibrator protocol (see the module docstring)."""

    def __call__(
        self,
        x: jax.Array,
        axes: Axes,
        *,
        qtype: QType,
        symmetric: bool = True,
        narrow_range: bool = False,
    ) -> tuple[jax.Array, jax.Array]:
        """Returns ``(lo, hi)`` reduced over ``axes`` with ``keepdims=True``."""
        ...


_MAX = numerics._MAX


def _nan_where(bad: jax.Array, lo: jax.Array, hi: jax.Array) -> tuple[jax.Array, jax.Array]:
    nan = jnp.float32(jnp.nan)
    return jnp.where(bad, nan, lo), jnp.where(bad, nan, hi)


def _absmax(x: jax.Array, axes: Axes) -> jax.Array:
    """``max |x|`` per block; ``NaN`` for a block holding ``NaN`` or ``±inf``.

    The max already sees every value (``NaN`` and ``inf`` both reach it), so the
    rule costs no extra pass over ``x``.
    """
    x = jnp.asarray(x, jnp.float32)
    m = jnp.max(jnp.abs(x), axis=tuple(axes), keepdims=True, initial=0.0)
    return numerics._select(m <= _MAX, m, jnp.nan)


def _minmax(x: jax.Array, axes: Axes) -> tuple[jax.Array, jax.Array]:
    """``[min(x, 0), max(x, 0)]`` per block; ``NaN`` for a non-finite block."""
    x = jnp.asarray(x, jnp.float32)
    axes = tuple(axes)
    lo = jnp.min(x, axis=axes, keepdims=True, initial=0.0)
    hi = jnp.max(x, axis=axes, keepdims=True, initial=0.0)
    return _nan_where(~(jnp.isfinite(lo) & jnp.isfinite(hi)), lo, hi)


def _all_finite(x: jax.Array, axes: Axes) -> jax.Array:
    return jnp.all(jnp.isfinite(x), axis=tuple(axes), keepdims=True)


def _normalized_mean(fn, x: jax.Array, axes: Axes) -> tuple[jax.Array, jax.Array]:
    """``(m, mean(fn(x / m)))`` per block with ``m = max|x|`` (``NaN`` if not finite).

    Dividing by the block's max first keeps ``mean(x²)`` and ``mean(|x|)`` finite
    for values near float32's maximum.
    """
    m = _absmax(x, axes)
    safe = jnp.where(m > 0, m, jnp.float32(1.0))
    return m, jnp.mean(fn(numerics.divide(x, safe)), axis=tuple(axes), keepdims=True)


@dataclasses.dataclass(frozen=True)
class AbsMax:
    """``±clip · max|x|``; ``clip < 1`` trades outlier clipping for resolution."""

    clip: float = 1.0

    def __call__(self, x, axes, *, qtype, symmetric=True, narrow_range=False):  # noqa: D102
        m = self.bound(x, axes)
        return -m, m

    def bound(self, x: jax.Array, axes: Axes) -> jax.Array:
        """``clip · max|x|`` per block, at most float32's maximum; ``NaN`` if not finite.

        A symmetric calibration uses it as the scale's bound directly (the range is
        ``(-bound, bound)``), skipping :func:`qcore.numerics.scale_from_range`.
        """
        m = _absmax(x, axes)
        if self.clip == 1.0:
            return m  # already within float32's range (x · 1 and min(x, max) are x)
        return jnp.minimum(m * self.clip, _MAX)


@dataclasses.dataclass(frozen=True)
class MinMax:
    """``[min(x), max(x)]`` widened to include 0, so zero is exactly representable."""

    def __call__(self, x, axes, *, qtype, symmetric=True, narrow_range=False):  # noqa: D102
        return _minmax(x, axes)


@dataclasses.dataclass(frozen=True)
class Rms:
    """``±k · sqrt(mean(x²))``, computed without overflow (``x`` is divided by its max)."""

    k: float

    def __call__(self, x, axes, *, qtype, symmetric=True, narrow_range=False):  # noqa: D102
        m, ms = _normalized_mean(jnp.square, x, axes)
        r = jnp.minimum(m * jnp.sqrt(ms) * self.k, _MAX)
        return -r, r


@dataclasses.dataclass(frozen=True)
class Fixed:
    """A constant range ``[lo, hi]`` (e.g. ``Fixed(-6, 6)`` for ReLU6 outputs)."""

    lo: float
    hi: float

    def __call__(self, x, axes, *, qtype, symmetric=True, narrow_range=False):  # noqa: D102
        ok = _all_finite(x, _normalize(axes, x.ndim))
        lo, hi = (jnp.full(ok.shape, v, jnp.float32) for v in (self.lo, self.hi))
        return _nan_where(~ok, lo, hi)


@dataclasses.dataclass(frozen=True)
class Percentile:
    """The ``q``-th percentile of ``|x|`` (symmetric) or of ``x`` at both tails."""

    q: float

    def __call__(self, x, axes, *, qtype, symmetric=True, narrow_range=False):  # noqa: D102
        flat, shape = _move_to_last(jnp.asarray(x, jnp.float32), axes)
        if symmetric:
            hi = jnp.percentile(jnp.abs(flat), self.q, axis=-1)
            lo = -hi
        else:
            lo = jnp.percentile(flat, 100.0 - self.q, axis=-1)
            hi = jnp.percentile(flat, self.q, axis=-1)
        lo, hi = _nan_where(~_all_finite(flat, (-1,))[..., 0], lo, hi)
        return lo.reshape(shape), hi.reshape(shape)


@dataclasses.dataclass(frozen=True)
class Mse:
    """Per-block search of the clipping ratio minimising the squared error.

    Tries ``steps`` ratios evenly spaced in ``[min_ratio, 1]`` of the absmax
    range (minmax when asymmetric), quantizing with round-to-nearest-even, and
    keeps each block's best. Ratio 1 is always a candidate, so the result is
    never worse than absmax/minmax. For ``int1`` the optimum is exact:
    ``±mean|x|``.
    """

    steps: int = 32
    min_ratio: float = 0.3

    def __call__(self, x, axes, *, qtype, symmetric=True, narrow_range=False):  # noqa: D102
        axes = tuple(axes)
        xf = jnp.asarray(x, jnp.float32)
        if qtype.kind == "binary":
            # Codes are sign(x) whatever the scale, so the squared error
            # sum((|x| - s)^2) has its minimum in closed form at s = mean|x|.
            m, mean = _normalized_mean(jnp.abs, xf, axes)
            s = m * mean
            return -s, s
        base_lo, base_hi = _minmax(xf, axes) if not symmetric else AbsMax()(xf, axes, qtype=qtype)
        norm = jnp.maximum(jnp.maximum(-base_lo, base_hi), jnp.float32(numerics._TINY))

        def error(ratio: jax.Array) -> jax.Array:
            scale, zp = numerics.scale_from_range(
                base_lo * ratio,
                base_hi * ratio,
                qtype,
                symmetric=symmetric,
                narrow_range=narrow_range,
            )
            shift = 0.0 if zp is None else zp
            v = numerics.divide(xf, scale) + shift
            codes = numerics.encode(v, qtype, narrow_range=narrow_range)
            xq = (numerics.decode(codes, qtype) - shift) * scale
            # Errors relative to the block's bound, so squares of huge values stay finite.
            return jnp.sum(jnp.square(numerics.divide(xq - xf, norm)), axis=axes, keepdims=True)

        def step(carry, ratio):
            best_err, best_ratio = carry
            err = error(ratio)
            better = err < best_err
            return (jnp.where(better, err, best_err), jnp.where(better, ratio, best_ratio)), None

        ones = jnp.ones_like(base_hi)
        ratios = jnp.linspace(self.min_ratio, 1.0, self.steps, dtype=jnp.float32)
        init = (error(jnp.float32(1.0)), ones)
        (_, best), _ = jax.lax.scan(step, init, ratios[:-1])
        return base_lo * best, base_hi * best


def _normalize(axes: Axes, ndim: int) -> tuple[int, ...]:
    return tuple(a % ndim for a in axes) if ndim else ()


def _move_to_last(x: jax.Array, axes: Axes) -> tuple[jax.Array, tuple[int, ...]]:
    """Moves ``axes`` to the end and flattens them; returns the keepdims shape."""
    axes = _normalize(axes, x.ndim)
    keep = [i for i in range(x.ndim) if i not in axes]
    moved = jnp.transpose(x, (*keep, *axes))
    flat = moved.reshape(*(x.shape[i] for i in keep), -1)
    shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    return flat, shape


# The built-in calibrators: each gives a block holding NaN or ±inf a NaN range.
BUILTINS = (AbsMax, MinMax, Rms, Fixed, Percentile, Mse)

_NAMES = ("absmax", "minmax", "rms", "fixed", "percentile", "mse")

_SYNTAX = {
    "absmax": "'absmax' or 'absmax,<clip>' (e.g. 'absmax,0.9')",
    "minmax": "'minmax'",
    "rms": "'rms,<k>' (e.g. 'rms,3')",
    "fixed": "'fixed,<lo>,<hi>' or 'fixed,<bound>' (e.g. 'fixed,-6,6' or 'fixed,6')",
    "percentile": "'percentile,<q>' (e.g. 'percentile,99.9')",
    "mse": "'mse', 'mse,<steps>' or 'mse,<steps>,<min_ratio>' (e.g. 'mse,64,0.1')",
}


def parse(calibration: str | Calibrator) -> Calibrator:
    """Parses a calibration string (see the module docstring); callables pass through.

    Raises:
        ValueError: For an unknown method name, a wrong number of arguments,
            non-numeric arguments or values outside their allowed ranges.
    """
    if callable(calibration):
        return calibration
    if not isinstance(calibration, str):
        raise ValueError(
            f"calibration={calibration!r} must be a string like 'absmax,0.9' or a "
            f"calibrator callable; methods: {', '.join(_NAMES)}"
        )
    name, *raw = [p.strip() for p in calibration.split(",")]
    name = name.lower()

    def bad(msg: str) -> ValueError:
        return ValueError(f"calibration={calibration!r}: {msg}")

    try:
        args = [float(a) for a in raw]
    except ValueError:
        raise bad(f"arguments {raw} must be numbers") from None
    for a, text in zip(args, raw, strict=True):
        if not abs(a) <= _MAX:  # also NaN; ranges are float32
            raise bad(
                f"argument {text!r} is not a finite float32; allowed: numbers with "
                f"|value| <= {_MAX:.7g}"
            )
    if name not in _SYNTAX:
        raise bad(f"unknown method {name!r}; allowed: {', '.join(_NAMES)}")
    arity = {"absmax": (0, 1), "minmax": (0,), "rms": (1,), "fixed": (1, 2)}
    arity |= {"percentile": (1,), "mse": (0, 1, 2)}
    if len(args) not in arity[name]:
        raise bad(
            f"{name!r} takes {' or '.join(map(str, arity[name]))} argument(s), got "
            f"{len(args)}; write {_SYNTAX[name]}; methods: {', '.join(_NAMES)}"
        )
    if name == "absmax":
        clip = args[0] if args else 1.0
        if not clip > 0:
            raise bad(f"clip={clip} must be > 0")
        return AbsMax(clip)
    if name == "minmax":
        return MinMax()
    if name == "rms":
        if not args[0] > 0:
            raise bad(f"k={args[0]} must be > 0")
        return Rms(args[0])
    if name == "fixed":
        if len(args) == 1:
            if not args[0] > 0:
                raise bad(
                    f"bound={args[0]} must be > 0 ('fixed,<bound>' is the range -bound..bound)"
                )
            args = [-args[0], args[0]]
        lo, hi = args
        if not lo < hi:
            raise bad(f"lo={lo} must be < hi={hi}")
        return Fixed(lo, hi)
    if name == "percentile":
        if not 0 < args[0] <= 100:
            raise bad(f"q={args[0]} must be in (0, 100]")
        return Percentile(args[0])
    steps = args[0] if args else 32
    if steps < 2 or steps != int(steps):
        raise bad(f"steps={steps} must be an integer >= 2")
    min_ratio = args[1] if len(args) > 1 else 0.3
    if not 0 < min_ratio < 1:
        raise bad(f"min_ratio={min_ratio} must be in (0, 1)")
    return Mse(int(steps), min_ratio)
