"""Quantized parameters as they live in a model's param tree.

A :class:`QuantizedParam` holds the :class:`~qcore.QArray` an op computes with and,
as static data, the :class:`Recipe` that made it from the float parameter: the
qcore spec, the reshapes/transposes the module applied to the parameter before
the op (the QArray is stored in that *compute layout*, so scales follow the op's
channels), and the float parameter's shape and dtype. The recipe is what lets
:func:`qflax.quantize_params` quantize a float checkpoint without running the
model, bit-identically to quantizing inside it.

An :class:`ActScale` is a stored static activation scale, and names the
statistic it is computed from.

Parameters stacked by ``nn.scan`` / ``nnx.vmap`` carry extra leading axes; the
recipe describes one layer and :func:`quantize_param` maps over the rest.

Example:
    >>> import jax.numpy as jnp
    >>> import qcore
    >>> from qflax.qparam import Recipe, quantize_param, stand_in
    >>> spec = qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,))
    >>> recipe = Recipe(
    ...     spec=spec,
    ...     transforms=(),
    ...     shape=(4, 3),
    ...     dtype=jnp.dtype("float32"),
    ...     compute_dtype=jnp.dtype("float32"),
    ... )
    >>> qp = quantize_param(jnp.arange(12.0).reshape(4, 3), recipe)
    >>> qp.qarray.qvalue.dtype, qp.qarray.scale.shape
    (dtype('int8'), (1, 3))
    >>> stand_in(qp).shape
    (4, 3)
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

import qcore
from qflax.rotation import Hadamard, rotate

Transform = tuple[str, tuple[int, ...]]  # ("reshape", new shape) or ("transpose", perm)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a float parameter becomes the QArray an op uses (static, hashable).

    Attributes:
        spec: The qcore spec, in the compute layout.
        transforms: ``("reshape", shape)`` / ``("transpose", perm)`` steps from the
            parameter's layout to the compute layout, in order.
        shape: The float parameter's shape (one layer).
        dtype: The float parameter's dtype.
        compute_dtype: The dtype the op saw (the QArray dequantizes to it).
        rotation: A :class:`~qflax.rotation.Hadamard` rotation applied to the
            compute-layout weight before quantizing (the QArray holds the
            rotated weight), or None.
        input_scale_axis: If not None, the :class:`QuantizedParam` carries a
            per-input-channel scale ``s`` for this compute-layout axis (the
            op's contracting axis): the QArray holds ``s * W`` and the op's
            other operand is divided by ``s`` (AWQ and SmoothQuant without a
            fold target; see :mod:`qflax.awq`).
    """

    spec: qcore.HowToQuantize
    transforms: tuple[Transform, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    compute_dtype: np.dtype
    rotation: Hadamard | None = None
    input_scale_axis: int | None = None

    def compute_shape(self) -> tuple[int, ...]:
        """The parameter's shape after the transforms."""
        shape = self.shape
        for kind, arg in self.transforms:
            shape = arg if kind == "reshape" else tuple(shape[a] for a in arg)
        return tuple(shape)


class QuantizedParam:
    """A quantized weight in the param tree: a QArray plus its :class:`Recipe`.

    Args:
        qarray: The quantized weight, in the recipe's compute layout.
        recipe: How it was made (static).
        input_scale: With ``recipe.input_scale_axis`` set, the ``(K,)`` float32
            per-input-channel scale ``s`` (the QArray holds ``s * W``); else None.
    """

    __slots__ = ("input_scale", "qarray", "recipe")

    def __init__(
        self, qarray: qcore.QArray, recipe: Recipe, input_scale: jax.Array | None = None
    ) -> None:
        if (input_scale is None) != (recipe.input_scale_axis is None):
            raise ValueError(
                f"input_scale={'None' if input_scale is None else 'an array'} does not match "
                f"recipe.input_scale_axis={recipe.input_scale_axis}: give both or neither"
            )
        self.qarray = qarray
        self.recipe = recipe
        self.input_scale = input_scale

    def tree_flatten_with_keys(self):  # noqa: D102 - pytree protocol
        children: list[tuple[Any, Any]] = [(jax.tree_util.GetAttrKey("qarray"), self.qarray)]
        if self.recipe.input_scale_axis is not None:
            children.append((jax.tree_util.GetAttrKey("input_scale"), self.input_scale))
        return tuple(children), self.recipe

    @classmethod
    def tree_unflatten(cls, recipe, children):  # noqa: D102 - pytree protocol
        obj = object.__new__(cls)
        obj.qarray, obj.recipe = children[0], recipe
        obj.input_scale = children[1] if len(children) > 1 else None
        return obj

    @property
    def shape(self) -> tuple[int, ...]:
        """The float parameter's shape, with any stacking axes in front."""
        lead = self.qarray.ndim - len(self.recipe.compute_shape())
        return tuple(self.qarray.shape[:lead]) + self.recipe.shape

    @property
    def dtype(self) -> np.dtype:
        """The float parameter's dtype."""
        return self.recipe.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scales, zero points and the input scale, if any."""
        s = self.input_scale
        extra = 0 if s is None else int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize
        return self.qarray.nbytes + extra

    def __getitem__(self, index: Any) -> QuantizedParam:
        # nnx.Variable.get_value indexes with ``...`` before its hooks run.
        if index is not Ellipsis:
            raise TypeError(f"a QuantizedParam cannot be indexed with {index!r}")
        return self

    def __repr__(self) -> str:
        spec = self.recipe.spec
        packed = ", packed" if spec.pack else ""
        scaled = ", input-scaled" if self.recipe.input_scale_axis is not None else ""
        return (
            f"QuantizedParam({spec.resolved_qtype.name}, shape={self.recipe.shape}, "
            f"compute shape={self.recipe.compute_shape()}{packed}{scaled})"
        )


jax.tree_util.register_pytree_with_keys_class(QuantizedParam)


@dataclasses.dataclass(frozen=True)
class ScaleRecipe:
    """How a static activation scale is made from its statistic (static, hashable).

    Attributes:
        qtype: The activation's qtype name.
        stat: The statistic's name in the module's ``quant_stats``.
    """

    qtype: str
    stat: str


class ActScale:
    """A stored static activation scale (per tensor) and its :class:`ScaleRecipe`."""

    __slots__ = ("recipe", "scale")

    def __init__(self, scale: jax.Array, recipe: ScaleRecipe) -> None:
        self.scale = scale
        self.recipe = recipe

    def tree_flatten_with_keys(self):  # noqa: D102 - pytree protocol
        return ((jax.tree_util.GetAttrKey("scale"), self.scale),), self.recipe

    @classmethod
    def tree_unflatten(cls, recipe, children):  # noqa: D102 - pytree protocol
        return cls(children[0], recipe)

    def __repr__(self) -> str:
        return f"ActScale({self.recipe.qtype}, from {self.recipe.stat!r})"


jax.tree_util.register_pytree_with_keys_class(ActScale)


def to_compute_layout(value: jax.Array, recipe: Recipe) -> jax.Array:
    """Applies the recipe's transforms and cast to one layer's float parameter."""
    x = value
    for kind, arg in recipe.transforms:
        x = x.reshape(arg) if kind == "reshape" else jnp.transpose(x, arg)
    return x.astype(recipe.compute_dtype)


@partial(jax.jit, static_argnums=(1,))
def _quantize_one(value: jax.Array, recipe: Recipe) -> qcore.QArray:
    x = to_compute_layout(value, recipe)
    if recipe.rotation is not None:
        x = rotate(x, recipe.rotation.axis, recipe.rotation.seed)
    return qcore.quantize(x, recipe.spec)


def nonfinite_count(x: Any) -> int | None:
    """How many values of a concrete array are NaN or +-inf; None under tracing.

    Example:
        >>> import jax.numpy as jnp
        >>> nonfinite_count(jnp.array([1.0, jnp.nan, jnp.inf])), nonfinite_count(jnp.ones(2))
        (2, 0)
    """
    if isinstance(x, Tracer):
        return None
    with jax.ensure_compile_time_eval():  # a concrete value inside a trace stays concrete
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            return 0
        return int(jnp.sum(~jnp.isfinite(x)))


def check_finite_weight(value: Any, path: str) -> None:
    """Raises if a concrete weight about to be quantized holds NaN or +-inf.

    Quantizing would turn them into NaN blocks (or, worse, plausible numbers)
    without telling anyone; under tracing nothing can be raised and qcore's NaN
    policy applies.

    Raises:
        ValueError: Naming the param and how many values are bad.
    """
    bad = nonfinite_count(value)
    if bad:
        raise ValueError(
            f"param {path!r} has {bad} non-finite values (NaN or inf); quantizing would hide "
            "them: fix or mask the weights first"
        )


def quantize_param(value: jax.Array, recipe: Recipe) -> QuantizedParam:
    """Quantizes a float parameter (stacking axes in front allowed) by its recipe.

    Raises:
        ValueError: If ``value``'s trailing shape is not the recipe's shape.
    """
    value = jnp.asarray(value)
    n = len(recipe.shape)
    if tuple(value.shape[value.ndim - n :]) != recipe.shape or value.ndim < n:
        raise ValueError(
            f"param shape {tuple(value.shape)} does not end with the quantized layout's "
            f"parameter shape {recipe.shape}"
        )
    fn = partial(_quantize_one, recipe=recipe)
    for _ in range(value.ndim - n):
        fn = jax.vmap(fn)
    return QuantizedParam(fn(value), recipe)


def stand_in(qp: QuantizedParam) -> jax.Array:
    """The dequantized weight in the parameter's own layout and dtype.

    Modules receive it in place of the QuantizedParam; intercepted ops recognise it
    and use the QArray instead, so under ``jax.jit`` it is dead code unless the
    module also uses the weight outside an intercepted op.
    """
    x = qcore.dequantize(qp.qarray)
    lead = x.ndim - len(qp.recipe.compute_shape())
    if qp.recipe.rotation is not None:  # undo it: the module sees the float weight
        x = rotate(x, lead + qp.recipe.rotation.axis, qp.recipe.rotation.seed, inverse=True)
    if qp.input_scale is not None:  # the QArray holds s * W
        assert qp.recipe.input_scale_axis is not None
        x = divide_along(x, qp.input_scale, lead + qp.recipe.input_scale_axis)
    shapes = [qp.recipe.shape]
    for kind, arg in qp.recipe.transforms:
        prev = shapes[-1]
        shapes.append(arg if kind == "reshape" else tuple(prev[a] for a in arg))
    for (kind, arg), prev in zip(
        reversed(qp.recipe.transforms), reversed(shapes[:-1]), strict=True
    ):
        if kind == "reshape":
            x = x.reshape(x.shape[:lead] + tuple(prev))
        else:
            inverse = tuple(int(i) for i in np.argsort(arg))
            x = jnp.transpose(x, tuple(range(lead)) + tuple(lead + a for a in inverse))
    return x.astype(qp.recipe.dtype)


def divide_along(x: jax.Array, s: jax.Array, axis: int) -> jax.Array:
    """``x / s`` with ``s`` (shape ``(x.shape[axis],)``) along ``axis``, in float32, as x's dtype.

    Example:
        >>> import jax.numpy as jnp
        >>> from qflax.qparam import divide_along
        >>> divide_along(jnp.ones((2, 3)), jnp.array([1.0, 2.0, 4.0]), 1).tolist()
        [[1.0, 0.5, 0.25], [1.0, 0.5, 0.25]]
    """
    shape = [1] * x.ndim
    shape[axis] = s.shape[-1]
    return (x.astype(jnp.float32) / s.astype(jnp.float32).reshape(shape)).astype(x.dtype)
