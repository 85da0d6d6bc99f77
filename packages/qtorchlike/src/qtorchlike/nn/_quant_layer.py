"""What every quantized layer shares: quantizer arguments and prefixed keyword overrides.

A layer takes quantizers as classes (``weight_quant=Int8WeightPerChannelFloat``),
as ``None`` (no quantization), or as a proxy of another layer
(``weight_quant=conv1.weight_quant``: shared). Keyword arguments with a
quantizer's prefix override that quantizer's attributes: ``weight_bit_width=4``
becomes ``weight_quant.let(bit_width=4)``. With the quantizer ``None``,
prefixed keywords define one inline (``output_quant_type="int", ...``). A
keyword that matches no prefix is an error (Brevitas ignores it silently).
"""

from __future__ import annotations

import difflib
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qtorchlike import inject, random
from qtorchlike._errors import NoQuantTensorError
from qtorchlike._proxy import (
    ActQuantProxy,
    BiasQuantProxy,
    QuantProxy,
    WeightQuantProxy,
    has_quant,
    is_quant,
)
from qtorchlike._zero_point import (
    has_zero_point,
    make_act_proxy,
    make_weight_proxy,
    may_have_zero_point,
)
from qtorchlike.nn.module import Module, Parameter
from qtorchlike.quant_tensor import QuantTensor
from qtorchlike.solver import ATTRIBUTES, QuantSpec, ScalingPerOutputType


def kaiming_uniform(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    """PyTorch's default layer initialisation: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def split_kwargs(
    layer: str, kwargs: dict[str, Any], prefixes: tuple[str, ...]
) -> dict[str, dict[str, Any]]:
    """Groups keyword overrides by quantizer prefix (the empty prefix takes the rest).

    Raises:
        TypeError: If a keyword matches no prefix.
    """
    out: dict[str, dict[str, Any]] = {p: {} for p in prefixes}
    for key, val in kwargs.items():
        prefix = next((p for p in prefixes if p and key.startswith(p)), None)
        if prefix is None and "" in prefixes:
            prefix = ""
        if prefix is None:
            allowed = ", ".join(f"{p}<attribute>" for p in prefixes)
            raise TypeError(
                f"{layer}() got an unexpected keyword argument {key!r}; quantizer overrides "
                f"take a prefix: {allowed} (e.g. weight_bit_width=4)"
            )
        out[prefix][key[len(prefix) :]] = val
    return out


def _known(quant: type | None) -> set[str]:
    """Attribute names an override may set: the solver's, the quantizer's, its @value inputs."""
    names = set(ATTRIBUTES)
    if quant is not None:
        for name in inject._public_names(quant):
            names.add(name)
            raw = inject._raw(quant, name)
            if isinstance(raw, inject._Value):
                names.update(p.name for p in raw.params)
    return names


def _check_overrides(
    quant: type | None, overrides: dict[str, Any], arg: str, layer: str = ""
) -> None:
    known = _known(quant)
    unknown = sorted(set(overrides) - known)
    if not unknown:
        return
    name = unknown[0]
    prefix = "" if arg == "act_quant" else arg.removesuffix("quant")
    near = difflib.get_close_matches(name, sorted(known), n=2)
    hint = f"did you mean {' or '.join(repr(n) for n in near)}? " if near else ""
    what = f"{arg}={quant.__name__}" if quant is not None else f"an inline {arg}"
    where = f"{layer}() got an " if layer else ""
    raise TypeError(
        f"{where}unexpected keyword argument {prefix + name!r}: {what} has no attribute {name!r}; "
        f"{hint}allowed: {prefix}<attribute> with an attribute of the quantizer or one of "
        f"{sorted(ATTRIBUTES)}"
    )


def _injector(quant: Any, overrides: dict[str, Any], arg: str, layer: str = "") -> type | None:
    if quant is None or (isinstance(quant, type) and issubclass(quant, inject.ExtendedInjector)):
        _check_overrides(quant, overrides, arg, layer)
    if quant is None:
        # A quantizer defined inline by prefixed keywords is named after its argument.
        return type(arg, (inject.ExtendedInjector,), dict(overrides)) if overrides else None
    if isinstance(quant, type) and issubclass(quant, inject.ExtendedInjector):
        return quant.let(**overrides) if overrides else quant
    raise TypeError(
        f"{arg}={quant!r} must be a quantizer class (e.g. qtorchlike.quant."
        "Int8WeightPerTensorFloat), a quantizer proxy of another layer, or None"
    )


def _shared(quant: Any, overrides: dict[str, Any], arg: str, kind: type) -> Any:
    if not isinstance(quant, QuantProxy):
        return None
    if not isinstance(quant, kind):
        raise TypeError(f"{arg}={type(quant).__name__} cannot serve as a {kind.__name__}")
    if overrides:
        raise TypeError(
            f"{arg} is a shared proxy, so keyword overrides {sorted(overrides)} cannot apply; "
            "define a new quantizer class instead"
        )
    return quant


def _proxy_class(q: type | None, kind: type, arg: str) -> type:
    """The quantizer's ``proxy_class`` (Brevitas'), checked to be a ``kind``; else ``kind``."""
    if q is None or not inject.has(q, "proxy_class"):
        return kind
    cls = inject.resolve(q, "proxy_class", instantiate=False)
    if not (isinstance(cls, type) and issubclass(cls, kind)):
        raise TypeError(
            f"{arg}={q.__name__} has proxy_class={getattr(cls, '__name__', cls)!r}, which "
            f"cannot serve as {arg}; allowed: {kind.__name__} (Brevitas' "
            f"{kind.__name__}FromInjector) or a subclass of it"
        )
    return cls


def _naming(layer: str, arg: str, build: Any) -> Any:
    """``build()``, its ValueError or DependencyError prefixed with the layer and argument."""
    try:
        return build()
    except (ValueError, inject.DependencyError) as e:
        if not layer or str(e).startswith(layer):
            raise
        what = "" if str(e).startswith(f"{arg}=") else f"{arg}: "
        raise type(e)(f"{layer}(): {what}{e}") from e


def weight_proxy(
    layer: Module, quant: Any, overrides: dict, channel_axis: int = 0, input_axis: int = 1
) -> WeightQuantProxy:
    """A new (or shared) weight quantizer proxy tracking ``layer``'s weight (disabled if none)."""
    shared = _shared(quant, overrides, "weight_quant", WeightQuantProxy)
    if shared is not None:
        shared.track(layer, channel_axis, input_axis)
        return shared
    q = _injector(quant, overrides, "weight_quant", type(layer).__name__)
    cls = _proxy_class(q, WeightQuantProxy, "weight_quant")
    if cls is WeightQuantProxy:
        cls = make_weight_proxy  # maybe a zero point's
    return _naming(
        type(layer).__name__, "weight_quant", lambda: cls(q, layer, channel_axis, input_axis)
    )


def act_proxy(quant: Any, overrides: dict, arg: str, layer: str = "") -> ActQuantProxy:
    """A new (or shared) activation quantizer proxy (disabled if there is no quantizer)."""
    shared = _shared(quant, overrides, arg, ActQuantProxy)
    if shared is not None:
        return shared
    q = _injector(quant, overrides, arg, layer)
    cls = _proxy_class(q, ActQuantProxy, arg)
    if cls is ActQuantProxy:
        cls = make_act_proxy  # maybe a zero point's
    return _naming(layer, arg, lambda: cls(q))


def bias_proxy(quant: Any, overrides: dict, layer: str = "") -> BiasQuantProxy:
    """A new (or shared) bias quantizer proxy (disabled if there is no quantizer)."""
    shared = _shared(quant, overrides, "bias_quant", BiasQuantProxy)
    if shared is not None:
        return shared
    q = _injector(quant, overrides, "bias_quant", layer)
    cls = _proxy_class(q, BiasQuantProxy, "bias_quant")
    return _naming(layer, "bias_quant", lambda: cls(q))


def spec_of(proxy: QuantProxy | None) -> QuantSpec:
    """The spec of a proxy that the caller knows has a quantizer."""
    if not has_quant(proxy):
        raise RuntimeError("internal error: a quantizer expected here is missing")
    assert proxy is not None
    return proxy.spec


def max_uint(bits: Any) -> Any:
    """``2^bits - 1``: the largest magnitude a code of ``bits`` bits contributes."""
    return jnp.exp2(bits) - 1


def acc_bit_width(in_bits: Any, w_bits: Any, fan_in: int) -> Any:
    """Bits of an integer accumulator: ``ceil(log2(max_uint(a) * max_uint(w) * fan_in))``."""
    return jnp.ceil(jnp.log2(max_uint(in_bits) * max_uint(w_bits) * fan_in))


def apply_output(layer: Any, y: Any) -> Any:
    """Runs the output quantizer and returns a QuantTensor or its value as configured."""
    if has_quant(layer.output_quant):
        y = layer.output_quant(y)
    if layer.return_quant_tensor:
        if not isinstance(y, QuantTensor):
            raise NoQuantTensorError(
                f"{type(layer).__name__}(return_quant_tensor=True) produced a float output: "
                "quantize its input and weight (input_quant=..., or feed a QuantTensor) or set "
                "output_quant=..."
            )
        return y
    return y.value if isinstance(y, QuantTensor) else y


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool (NumPy's included), else a TypeError naming ``name``."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name}={value!r} must be True or False")
    return bool(value)


def check_positive_ints(**named: Any) -> None:
    """Each value is a positive int (not a bool), else a ValueError naming it."""
    for name, v in named.items():
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive int")


def check_key(key: Any) -> jax.Array:
    """A JAX PRNG key (``jax.random.key(0)`` or ``jax.random.PRNGKey(0)``), else a TypeError."""
    try:
        jax.random.split(key)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"key={key!r} must be a JAX PRNG key, e.g. jax.random.key(0) or jax.random.PRNGKey(0)"
        ) from e
    return key


def check_input(layer: Module, x: Any) -> Any:
    """``x`` (a QuantTensor) or ``x`` as a floating-point array; else a TypeError naming it."""
    if isinstance(x, QuantTensor):
        return x
    name = type(layer).__name__
    try:
        arr = x if isinstance(x, jax.Array) else jnp.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{name} got an input of type {type(x).__name__}; allowed: a floating-point "
            "array (jax.Array, numpy.ndarray) or a QuantTensor"
        ) from e
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        raise TypeError(
            f"{name} got an input of dtype {arr.dtype}; allowed: a floating-point array "
            "(e.g. float32) or a QuantTensor"
        )
    return arr


def fan_in(weight_shape: tuple[int, ...], in_axis: int = 1) -> int:
    """Inputs summed per output: the input channels times the kernel size."""
    spatial = weight_shape[2:]
    return int(weight_shape[in_axis] * math.prod(spatial))


class QuantWBIOL(Module):
    """Base of layers with a weight, a bias, and input/output quantizers.

    Subclasses create ``weight`` (and ``bias``) and define :meth:`_float_op`
    (float computation on values) and optionally :meth:`_int_op` (the
    integer path through qcore, used in eval mode when input and weight are
    integer QuantTensors).
    """

    _channel_axis = 0
    _input_axis = 1
    _out_channel_dim = 1  # where output channels sit in the output (1: NC...)

    def _init_params(
        self, shape: tuple[int, ...], fan_in: int, n_out: int, bias: bool, key: jax.Array | None
    ) -> None:
        """PyTorch's initial ``weight`` of ``shape`` and, with ``bias``, ``n_out`` biases."""
        check_bool("bias", bias)
        kw, kb = jax.random.split(random.next_key() if key is None else check_key(key))
        self.weight = Parameter(kaiming_uniform(kw, shape, fan_in))
        if bias:
            self.bias = Parameter(kaiming_uniform(kb, (n_out,), fan_in))
        else:
            self.register_parameter("bias", None)

    def _init_quant(
        self,
        weight_quant: Any,
        bias_quant: Any,
        input_quant: Any,
        output_quant: Any,
        return_quant_tensor: bool,
        kwargs: dict[str, Any],
    ) -> None:
        groups = split_kwargs(
            type(self).__name__, kwargs, ("weight_", "bias_", "input_", "output_")
        )
        self.weight_quant = weight_proxy(
            self, weight_quant, groups["weight_"], self._channel_axis, self._input_axis
        )
        name = type(self).__name__
        self.bias_quant = bias_proxy(bias_quant, groups["bias_"], name)
        self.input_quant = act_proxy(input_quant, groups["input_"], "input_quant", name)
        self.output_quant = act_proxy(output_quant, groups["output_"], "output_quant", name)
        self.return_quant_tensor = check_bool("return_quant_tensor", return_quant_tensor)

    def quant_weight(self) -> Any:
        """The weight as this layer uses it: a QuantTensor, or the float weight."""
        if not has_quant(self.weight_quant):
            return self.weight
        return self.weight_quant(self.weight, self._channel_axis, self._input_axis)

    def _check_shape(self, x: Any) -> None:
        """Raises ValueError if ``x`` (an array) has a shape this layer cannot take."""

    def _float_op(self, x: Any, w: Any) -> Any:
        raise NotImplementedError

    def _int_op(self, x: QuantTensor, w: QuantTensor) -> Any:
        return None

    def _integer_operands(self) -> bool:
        """Whether this layer's own quantizers give integer codes of at most 8 bits.

        Codes with a zero point do not qualify (the integer path multiplies codes),
        nor an input with per-channel scales (the sum over input channels mixes them).
        """
        proxies = (self.input_quant, self.weight_quant)
        return all(
            p.is_quant_enabled
            and is_quant(p.spec)
            and p.spec.bit_width <= 8
            and not has_zero_point(p.spec)
            for p in proxies
        ) and (self.input_quant.spec.per is ScalingPerOutputType.TENSOR)

    def _channel_shape(self, ndim: int, n: int) -> tuple[int, ...]:
        shape = [1] * ndim
        shape[self._out_channel_dim % ndim] = n
        return tuple(shape)

    def forward(self, x: Any) -> Any:
        """Quantizes input and weight, computes, adds the (quantized) bias, quantizes output.

        Raises:
            TypeError: If ``x`` is neither a floating-point array nor a QuantTensor.
            ValueError: If ``x``'s shape does not fit the layer, or a concrete weight
                or bias holds NaN or ±inf (the message names the parameter).
        """
        x = check_input(self, x)
        self._check_shape(x.value if isinstance(x, QuantTensor) else x)
        xq = self.input_quant(x) if has_quant(self.input_quant) else x
        wq = self.quant_weight()
        both = isinstance(xq, QuantTensor) and isinstance(wq, QuantTensor)
        y = None
        if both and not self.training and self._integer_operands() and _finite(xq.scale):
            # A NaN scale (a non-finite input block) takes the float path, which is NaN there.
            y = self._int_op(xq, wq)
        if y is None:
            xv = xq.value if isinstance(xq, QuantTensor) else jnp.asarray(xq)
            wv = wq.value if isinstance(wq, QuantTensor) else wq
            y = self._float_op(xv, wv)
        bias = self.bias
        bq = None
        if bias is not None:
            if has_quant(self.bias_quant):
                bq = self.bias_quant(
                    bias,
                    xq.scale if isinstance(xq, QuantTensor) else None,
                    wq.scale if isinstance(wq, QuantTensor) else None,
                )
            else:
                bq = bias
            bv = bq.value if isinstance(bq, QuantTensor) else bq
            y = y + bv.reshape(self._channel_shape(y.ndim, bv.shape[0]))
        if both:
            _refuse_zero_point_output(self, xq, wq)
        n = y.shape[self._out_channel_dim % y.ndim]
        # An input with one scale per input channel leaves the sum with no single grid.
        per_channel = isinstance(wq, QuantTensor) and wq.scale.size in (1, n)
        per_channel = per_channel and isinstance(xq, QuantTensor) and xq.scale.size == 1
        if both and per_channel and _zero_point_free(xq) and _zero_point_free(wq):
            scale = xq.scale.reshape(-1) * wq.scale.reshape(-1)
            scale = jnp.broadcast_to(scale, (n,)) if scale.size != 1 else scale
            scale = scale.reshape(self._channel_shape(y.ndim, scale.size))
            bits = acc_bit_width(xq.bit_width, wq.bit_width, fan_in(self.weight.shape))
            zp = jnp.zeros((1,), y.dtype)  # Brevitas' shape for a layer's zero point
            if isinstance(bq, QuantTensor) and spec_of(self.bias_quant).requires_input_scale:
                bits = jnp.maximum(bits, bq.bit_width) + 1
            elif bq is not None:
                # A float (or separately scaled) bias shifts the integer grid; a
                # quantized one still adds its bit, as in Brevitas.
                if isinstance(bq, QuantTensor):
                    bits = jnp.maximum(bits, bq.bit_width) + 1
                bv = bq.value if isinstance(bq, QuantTensor) else bq
                zp = -bv.reshape(self._channel_shape(y.ndim, bv.shape[0])) / scale
            signed = bool(xq.signed or wq.signed)
            y = QuantTensor(y, scale, zp, bits, signed, self.training)
        return apply_output(self, y)


def _finite(scale: Any) -> bool:
    """Whether a concrete scale is finite everywhere (True under tracing)."""
    try:
        return bool(jnp.all(jnp.isfinite(scale)))
    except jax.errors.ConcretizationTypeError:
        return True


def _zero_point_free(q: QuantTensor) -> bool:
    # By value when concrete; under tracing, by type: only the zero-point quantizers
    # (ShiftedQuantTensor) give nonzero zero points (a float bias's shifted grid on a
    # layer's output is known only by value).
    return not may_have_zero_point(q)


def _refuse_zero_point_output(layer: Any, xq: QuantTensor, wq: QuantTensor) -> None:
    """A layer fed codes with a zero point computes in float and has no output grid.

    Brevitas raises there too ("Computing zero point of output accumulator not
    supported yet"); the float result itself is exact.
    """
    if not layer.return_quant_tensor or has_quant(layer.output_quant):
        return
    for what, q in (("input", xq), ("weight", wq)):
        if may_have_zero_point(q):
            proxy = layer.input_quant if what == "input" else layer.weight_quant
            source = f" ({proxy.spec.name})" if has_quant(proxy) else ""
            raise ValueError(
                f"{type(layer).__name__}(return_quant_tensor=True): its {what}{source} has a "
                "zero point, so the accumulator has no integer grid to return (Brevitas "
                "raises too); set output_quant=... to requantize the output, or "
                "return_quant_tensor=False for the float result"
            )
