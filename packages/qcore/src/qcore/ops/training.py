"""Quantized training: contractions whose forward and backward passes are quantized separately.

AQT's model: a matmul-like op ``y = op(lhs, rhs)`` has three contractions — the
forward one and the two that compute the gradients,
``dlhs = op_lhs_transpose(g, rhs)`` and ``drhs = op_rhs_transpose(lhs, g)``. A
:class:`TrainingQuant` configures each one on its own:

* ``lhs`` / ``rhs``: how the forward operands are quantized (``None`` keeps one in
  float). The forward runs the quantized op (integer path when both are integer).
* ``dlhs`` / ``drhs``: a :class:`BackwardQuant` saying how the incoming gradient
  ``g`` (``grad``, typically int8 with stochastic rounding) and the other forward
  operand (``operand``) are quantized in that gradient's contraction.

The default (only ``lhs``/``rhs`` set) is plain QAT: quantized forward and a
straight-through backward computed from the float residuals, so rounding never
blocks a gradient — in particular convolutions get real, non-zero gradients.
The backward contractions are evaluated on quantized-then-dequantized values in
float32, which equals the integer contraction up to float rounding. Scales are
constants (no gradient flows through calibration).

``HowToQuantize`` axes in ``grad`` specs refer to the axes of ``g``, which has the
op's output layout.

Example:
    >>> import jax, jax.numpy as jnp
    >>> import qcore
    >>> int8 = qcore.HowToQuantize(qtype="int8", channelwise_axes=(0,))
    >>> sr8 = qcore.HowToQuantize(qtype="int8", rounding="stochastic")
    >>> cfg = qcore.TrainingQuant(
    ...     lhs=int8,
    ...     rhs=qcore.HowToQuantize(qtype="int8"),
    ...     dlhs=qcore.BackwardQuant(grad=sr8),
    ...     drhs=qcore.BackwardQuant(grad=sr8),
    ... )
    >>> x = jax.random.normal(jax.random.key(0), (4, 16))
    >>> w = jax.random.normal(jax.random.key(1), (16, 8))
    >>> def loss(w):
    ...     y = qcore.train_dot_general(x, w, (((1,), (0,)), ((), ())), cfg, key=jax.random.key(2))
    ...     return jnp.sum(y**2)
    >>> jax.grad(loss)(w).shape
    (16, 8)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from qcore.fakequant import in_calibrated_range
from qcore.ops.conv import check_conv, conv_general_dilated
from qcore.ops.dot_general import check_dims, dot_general
from qcore.ops.einsum import check_einsum, einsum
from qcore.ops.operand import preferred_dtype
from qcore.ops.ragged_dot import check_ragged, ragged_dot
from qcore.qarray import HowToQuantize, dequantize, quantize

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackwardQuant:
    """Quantization of one gradient contraction.

    Attributes:
        grad: How the incoming gradient ``g`` is quantized (axes refer to ``g``,
            which has the op's output layout), or None for float.
        operand: How the other forward operand is quantized in this contraction,
            or None to use its float value (the straight-through default).
    """

    grad: HowToQuantize | None = None
    operand: HowToQuantize | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingQuant:
    """Quantization of the forward and both gradient contractions of an op.

    Attributes:
        lhs: Forward quantization of the left operand, or None for float.
        rhs: Forward quantization of the right operand, or None for float.
        dlhs: Quantization of the contraction computing the lhs gradient.
        drhs: Quantization of the contraction computing the rhs gradient.
        clip_gradient: Zero each operand's gradient where it lies outside the range
            its forward spec calibrated (where the forward saturates), as
            ``fake_quant(..., clip_gradient=True)`` does.
    """

    lhs: HowToQuantize | None = None
    rhs: HowToQuantize | None = None
    dlhs: BackwardQuant = BackwardQuant()
    drhs: BackwardQuant = BackwardQuant()
    clip_gradient: bool = False

    def specs(self) -> list[HowToQuantize]:
        """Every spec that is set, forward first."""
        specs = [self.lhs, self.rhs, self.dlhs.grad, self.dlhs.operand]
        specs += [self.drhs.grad, self.drhs.operand]
        return [s for s in specs if s is not None]


def _maybe_quantize(x: Array, how: HowToQuantize | None, key: Array | None):
    return x if how is None else quantize(x, how, key=key)


def _fake(x: Array, how: HowToQuantize | None, key: Array | None) -> Array:
    """Quantize-dequantize (no gradient needed: used inside the backward pass)."""
    return x if how is None else dequantize(quantize(x, how, key=key), x.dtype)


def _train(
    quantized_op: Callable[..., Array],
    float_op: Callable[..., Array],
    lhs: Array,
    rhs: Array,
    aux: tuple[Array, ...],
    config: TrainingQuant,
    key: Array | None,
) -> Array:
    """Runs ``quantized_op`` forward with the custom backward described above.

    ``quantized_op(lhs, rhs, *aux)`` accepts QArrays; ``float_op(lhs, rhs, *aux)`` is
    the float op whose VJP gives the gradient contractions. ``aux`` holds
    non-differentiable arrays (e.g. ragged group sizes).
    """
    if not isinstance(config, TrainingQuant):
        raise ValueError(f"config={config!r} must be a qcore.TrainingQuant")
    stochastic = any(s.rounding == "stochastic" for s in config.specs())
    if stochastic and key is None:
        raise ValueError("config uses stochastic rounding: pass key=jax.random.key(...)")
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    if key is None:
        key = jax.random.key(0)  # unused: no spec rounds stochastically

    @jax.custom_vjp
    def op(lhs, rhs, aux, key):
        k1, k2, _, _ = jax.random.split(key, 4)
        qa = _maybe_quantize(lhs, config.lhs, k1)
        qb = _maybe_quantize(rhs, config.rhs, k2)
        return quantized_op(qa, qb, *aux)

    def mask(x: Array, how: HowToQuantize | None) -> Array | None:
        if not config.clip_gradient or how is None:
            return None
        return in_calibrated_range(x, how)

    def fwd(lhs, rhs, aux, key):
        masks = (mask(lhs, config.lhs), mask(rhs, config.rhs))
        return op(lhs, rhs, aux, key), (lhs, rhs, aux, key, masks)

    def bwd(res, g):
        lhs, rhs, aux, key, (mask_l, mask_r) = res
        _, _, k3, k4 = jax.random.split(key, 4)
        k3a, k3b = jax.random.split(k3)
        k4a, k4b = jax.random.split(k4)
        g = g.astype(jnp.float32)
        rhs_b = _fake(rhs, config.dlhs.operand, k3b).astype(jnp.float32)
        g_l = _fake(g, config.dlhs.grad, k3a)
        _, vjp_l = jax.vjp(lambda a: float_op(a, rhs_b, *aux), lhs.astype(jnp.float32))
        lhs_b = _fake(lhs, config.drhs.operand, k4b).astype(jnp.float32)
        g_r = _fake(g, config.drhs.grad, k4a)
        _, vjp_r = jax.vjp(lambda b: float_op(lhs_b, b, *aux), rhs.astype(jnp.float32))
        (dl,), (dr,) = vjp_l(g_l), vjp_r(g_r)
        if mask_l is not None:
            dl = jnp.where(mask_l, dl, jnp.zeros_like(dl))
        if mask_r is not None:
            dr = jnp.where(mask_r, dr, jnp.zeros_like(dr))
        return dl.astype(lhs.dtype), dr.astype(rhs.dtype), None, None

    op.defvjp(fwd, bwd)
    return op(lhs, rhs, tuple(aux), key)


def train_dot_general(
    lhs: Array,
    rhs: Array,
    dimension_numbers: Any,
    config: TrainingQuant,
    *,
    key: Array | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> Array:
    """``dot_general`` with a quantized forward and separately quantized gradients.

    Args:
        lhs: Float array.
        rhs: Float array.
        dimension_numbers: As in ``lax.dot_general``.
        config: The :class:`TrainingQuant`.
        key: PRNG key, required when a spec rounds stochastically.
        precision: Precision of the float contractions.
        preferred_element_type: Result dtype: None or a floating-point dtype.

    Raises:
        ValueError: For bad arguments, as :func:`qcore.dot_general` does.
    """
    check_dims(jnp.shape(lhs), jnp.shape(rhs), dimension_numbers)
    preferred_dtype(preferred_element_type)

    def q_op(a, b):
        return dot_general(a, b, dimension_numbers, precision, preferred_element_type)

    def f_op(a, b):
        return lax.dot_general(a, b, dimension_numbers, precision, jnp.float32)

    return _train(q_op, f_op, lhs, rhs, (), config, key)


def train_einsum(
    subscripts: str,
    lhs: Array,
    rhs: Array,
    config: TrainingQuant,
    *,
    key: Array | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> Array:
    """:func:`qcore.einsum` with a quantized forward and separately quantized gradients."""
    check_einsum(subscripts, jnp.shape(lhs), jnp.shape(rhs))
    preferred_dtype(preferred_element_type)

    def q_op(a, b):
        return einsum(
            subscripts, a, b, precision=precision, preferred_element_type=preferred_element_type
        )

    def f_op(a, b):
        return jnp.einsum(subscripts, a, b, precision=precision, preferred_element_type=jnp.float32)

    return _train(q_op, f_op, lhs, rhs, (), config, key)


def train_conv_general_dilated(
    lhs: Array,
    rhs: Array,
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    config: TrainingQuant,
    *,
    key: Array | None = None,
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> Array:
    """:func:`qcore.conv_general_dilated` with quantized forward and gradients."""
    conv = check_conv(
        jnp.shape(lhs),
        jnp.shape(rhs),
        window_strides,
        padding,
        lhs_dilation,
        rhs_dilation,
        dimension_numbers,
        feature_group_count,
        batch_group_count,
    )
    conv["precision"] = precision
    preferred_dtype(preferred_element_type)

    def q_op(a, b):
        return conv_general_dilated(a, b, preferred_element_type=preferred_element_type, **conv)

    def f_op(a, b):
        return lax.conv_general_dilated(a, b, preferred_element_type=jnp.float32, **conv)

    return _train(q_op, f_op, lhs, rhs, (), config, key)


def train_ragged_dot(
    lhs: Array,
    rhs: Array,
    group_sizes: Array,
    config: TrainingQuant,
    *,
    key: Array | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> Array:
    """:func:`qcore.ragged_dot` with quantized forward and gradients."""
    group_sizes = check_ragged(jnp.shape(lhs), jnp.shape(rhs), group_sizes)
    preferred_dtype(preferred_element_type)

    def q_op(a, b, gs):
        return ragged_dot(a, b, gs, precision, preferred_element_type)

    def f_op(a, b, gs):
        return lax.ragged_dot(a, b, gs, precision, jnp.float32)

    return _train(q_op, f_op, lhs, rhs, (jnp.asarray(group_sizes),), config, key)
