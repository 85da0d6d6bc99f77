"""Export: a model's integer weights and scales, and a full-integer LiteRT (``.tflite``) model.

:func:`integer_state_dict` lists, per quantized layer, what an integer
implementation needs: weight codes and scales, bias codes, and the scales of the
activation quantizers, as NumPy arrays.

:func:`export_tflite` converts a model with qlitert (``pip install
"jaxquant-qtorchlike[litert]"``): the model's quantized weights and biases become
constants, its activation quantizers' scales become the scales of the LiteRT
tensors they quantize, and the tensors LiteRT quantizes where the model does
not (the input, the output of a layer without ``output_quant``...) are
calibrated on the example input.

Example:
    >>> import numpy as np
    >>> import qtorchlike.nn as qnn
    >>> from qtorchlike.export import integer_state_dict
    >>> model = qnn.Sequential(qnn.QuantLinear(3, 2, weight_bit_width=4))
    >>> sd = integer_state_dict(model)
    >>> sorted(sd["0"])
    ['weight_bit_width', 'weight_int', 'weight_scale', 'weight_signed', 'weight_zero_point']
    >>> w = sd["0"]["weight_int"] * sd["0"]["weight_scale"]
    >>> bool(np.array_equal(w, np.asarray(model[0].quant_weight().value)))
    True
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import extend as jex
from jax import lax

from qtorchlike import functional as F
from qtorchlike._proxy import ActQuantProxy, QuantProxy, WeightQuantProxy, has_quant
from qtorchlike._switches import Switches, check_model, proxies
from qtorchlike._zero_point import ZeroPointActQuantProxy, has_zero_point
from qtorchlike.func import functional_call
from qtorchlike.nn._pool import TruncAvgPool2d
from qtorchlike.nn._quant_layer import QuantWBIOL
from qtorchlike.nn.module import Module, set_state
from qtorchlike.quant_tensor import QuantTensor
from qtorchlike.solver import QuantType, ScalingPerOutputType

__all__ = ["export_onnx", "export_tflite", "integer_state_dict"]

# The named scope that marks an activation quantizer's output for export_tflite.
_SITE = "qtorchlike_act:"


def _prefixed(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _act_scale(proxy: ActQuantProxy) -> jax.Array:
    """The evaluation-mode scale of an activation quantizer (no statistics update)."""
    scale = proxy.scale()
    assert scale is not None  # callers pass enabled quantizers
    return scale


def _capture_biases(model: Module, args: tuple) -> dict[str, QuantTensor]:
    """The quantized bias each layer uses, from one evaluation-mode forward pass.

    A bias quantizer may take its scale from the layer's input at run time, so the
    values are recorded from the bias quantizers' outputs.
    """
    layers = {
        id(m): n
        for n, m in model.named_modules()
        if isinstance(m, QuantWBIOL)
        and m.bias is not None
        and has_quant(m.bias_quant)
        and m.bias_quant.enabled
    }
    if not layers:
        return {}
    stack: list[str] = []
    found: dict[str, QuantTensor] = {}

    def enter(layer: Module, _args: tuple) -> None:
        stack.append(layers[id(layer)])

    def leave(layer: Module, _args: tuple, _out: Any) -> None:
        stack.pop()

    def record(proxy: Module, _args: tuple, out: Any) -> None:
        if stack and isinstance(out, QuantTensor):
            name = stack[-1]
            if name in found and not np.array_equal(np.asarray(found[name].value), out.value):
                warnings.warn(
                    f"layer {name!r} is called with inputs of different scales, so its "
                    "quantized bias differs between calls; the first call's is exported",
                    stacklevel=2,
                )
            found.setdefault(name, out)

    handles = []
    for m in model.modules():
        if id(m) in layers:
            handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
            handles.append(m.bias_quant.register_forward_hook(record))
    _eval_forward(model, args, handles)
    return found


def _eval_forward(model: Module, args: tuple, handles: list) -> None:
    """One evaluation-mode forward pass with ``handles``' hooks, which are then removed.

    The model's modes and switches are restored afterwards, also if it raises.
    """
    switches = Switches(model)
    try:
        model.eval()
        for p in proxies(model):
            if isinstance(p, ActQuantProxy):
                p.calibrating = False
        model(*args)
    finally:
        for h in handles:
            h.remove()
        switches.restore()


def _refuse_truncation(model: Module, args: tuple) -> None:
    """Raises ValueError for a TruncAvgPool2d that truncates on this input.

    Its window sums of codes shifted right to ``bit_width`` bits have no QDQ form
    (the export traces plain arrays, so it would be a plain average); one whose
    ``bit_width`` holds the sums computes the average exactly and exports.
    """
    found: list[str] = []
    names = {id(m): n for n, m in model.named_modules()}

    def check(pool: Module, inputs: tuple, _out: Any) -> None:
        acc = F.avg_pool2d(inputs[0], pool.kernel_size, pool.stride)
        if isinstance(acc, QuantTensor) and float(acc.bit_width) > pool.bit_width:
            found.append(
                f"layer {names[id(pool)]!r} (TruncAvgPool2d) truncates its "
                f"{float(acc.bit_width):g}-bit window sums to {pool.bit_width} bits"
            )

    handles = [
        m.register_forward_hook(check) for m in model.modules() if isinstance(m, TruncAvgPool2d)
    ]
    if handles:
        _eval_forward(model, args, handles)
    if found:
        raise ValueError(
            f"export_onnx: {found[0]}, which has no QDQ form; allowed: a bit_width that "
            "holds the sums, or AvgPool2d followed by an activation quantizer"
        )


def _quant_weighted(m: Module) -> bool:
    """Whether ``m`` quantizes a weight with its own proxy (layers, embeddings)."""
    return isinstance(m._modules.get("weight_quant"), WeightQuantProxy) and callable(
        getattr(m, "quant_weight", None)
    )


def _codes(q: QuantTensor, what: str) -> np.ndarray:
    try:
        return np.asarray(q.int())
    except ValueError as e:
        raise ValueError(f"integer_state_dict: {what} has no integer codes: {e}") from e


def integer_state_dict(model: Module, example_input: Any = None) -> dict[str, dict[str, Any]]:
    """Integer codes and quantization parameters of every quantized layer.

    For each module with an enabled quantizer (keyed by its dotted name, ``""``
    for the model itself; layers with weights, embeddings, activations), with
    evaluation-mode values:

    * ``weight_int`` (the codes, :meth:`QuantTensor.int`), ``weight_scale``,
      ``weight_zero_point``, ``weight_bit_width``, ``weight_signed``;
    * with a bias quantizer and a bias: ``bias_int``, ``bias_scale``,
      ``bias_zero_point``, ``bias_bit_width``, ``bias_signed``;
    * for each activation quantizer (``input_quant``, ``output_quant``,
      ``act_quant``): ``input_scale``, ``input_zero_point``, ``input_bit_width``,
      ``input_signed`` (``output_...``, ``act_...``).

    ``weight_int * weight_scale`` (after subtracting the zero point) is the
    weight the layer computes with. Arrays are NumPy; bit widths are ints and
    signedness bools.

    Args:
        model: The module.
        example_input: An input for one evaluation-mode forward pass, needed when
            a bias quantizer takes its scale from the layer's input (``Int32Bias``)
            and the layer has no ``input_quant``: the input's scale is then only
            known at run time.

    Returns:
        ``{layer name: {field: value}}``.

    Raises:
        TypeError: If ``model`` is not a :class:`qtorchlike.nn.Module`.
        ValueError: If a bias needs the input's scale and neither the layer's
            ``input_quant`` nor ``example_input`` gives it, or if a weight or bias
            quantizer has no integer codes (e.g. fp8).
    """
    check_model(model, "integer_state_dict")
    captured = _capture_biases(model, (example_input,)) if example_input is not None else {}
    out: dict[str, dict[str, Any]] = {}
    for name, m in model.named_modules():
        entry: dict[str, Any] = {}
        if _quant_weighted(m):
            wq = m.quant_weight()
            if isinstance(wq, QuantTensor):
                entry |= _fields("weight", wq, _codes(wq, f"layer {name!r}'s weight"))
        if isinstance(m, QuantWBIOL):
            bq = _bias(name, m, m.quant_weight(), captured)
            if bq is not None:
                entry |= _fields("bias", bq, _codes(bq, f"layer {name!r}'s bias"))
        for child, proxy in m.named_children():
            if isinstance(proxy, ActQuantProxy) and proxy.enabled:
                key = child.removesuffix("_quant")
                spec = proxy.spec
                entry[f"{key}_scale"] = np.asarray(_act_scale(proxy))
                entry[f"{key}_zero_point"] = _act_zero_point(proxy)
                entry[f"{key}_bit_width"] = int(spec.bit_width)
                entry[f"{key}_signed"] = spec.signed
        if entry:
            out[name] = entry
    return out


def _act_zero_point(proxy: ActQuantProxy) -> np.ndarray:
    """The evaluation-mode integer zero point of an activation quantizer (0 without one)."""
    zp = proxy.eval_zero_point() if isinstance(proxy, ZeroPointActQuantProxy) else None
    return np.zeros((), np.float32) if zp is None else np.asarray(zp, np.float32)


def _refuse_unexportable(model: Module) -> None:
    """Quantizers export_tflite cannot express: a ValueError naming layer and quantizer.

    LiteRT's int8 weights are symmetric, and the converter would re-round shifted
    codes instead of keeping them; activation zero points are refused as well rather
    than approximated. LiteRT's activations take one scale per tensor.
    """
    for name, m in model.named_modules():
        for child, proxy in m.named_children():
            if not (isinstance(proxy, QuantProxy) and proxy.is_quant_enabled):
                continue
            if (
                isinstance(proxy, ActQuantProxy)
                and proxy.spec.per is not ScalingPerOutputType.TENSOR
            ):
                raise ValueError(
                    f"export_tflite: layer {name!r} has {child}={proxy.spec.name} with per-channel "
                    f"scales of shape {proxy.spec.channel_shape}; LiteRT's activations take one "
                    "scale per tensor: use a per-tensor activation quantizer"
                )
            if has_zero_point(proxy.spec):
                raise ValueError(
                    f"export_tflite: layer {name!r} has {child}={proxy.spec.name}, whose codes "
                    "have a zero point; the LiteRT export supports zero-point-free (symmetric) "
                    "quantizers only, and would not reproduce these numbers. Use e.g. "
                    "Int8WeightPerChannelFloat / Uint8ActPerTensorFloat, or disable that "
                    "quantizer"
                )


def _fields(key: str, q: QuantTensor, codes: np.ndarray) -> dict[str, Any]:
    return {
        f"{key}_int": codes,
        f"{key}_scale": np.asarray(q.scale),
        f"{key}_zero_point": np.asarray(q.zero_point),
        f"{key}_bit_width": int(q.bit_width),
        f"{key}_signed": q.signed,
    }


def _bias(
    name: str, layer: QuantWBIOL, wq: Any, captured: dict[str, QuantTensor]
) -> QuantTensor | None:
    """The layer's quantized bias (None without a bias or an enabled bias quantizer)."""
    bias, proxy = layer.bias, layer.bias_quant
    if bias is None or proxy is None or not proxy.enabled:
        return None
    if name in captured:
        return captured[name]
    w_scale = wq.scale if isinstance(wq, QuantTensor) else None
    in_scale = None
    if layer.input_quant.is_quant_enabled:
        in_scale = _act_scale(layer.input_quant)
    if proxy.spec.requires_input_scale and (in_scale is None or w_scale is None):
        raise ValueError(
            f"integer_state_dict: layer {name!r} has bias_quant={proxy.spec.name}, whose scale "
            "is the input's scale x the weight's scale, but the layer has no input_quant, so "
            "the input's scale is only known at run time; pass example_input=<a batch> to "
            "record it from one forward pass"
        )
    out = proxy(bias, in_scale, w_scale)
    return out if isinstance(out, QuantTensor) else None


def _import_qlitert() -> Any:
    try:
        import qlitert  # noqa: PLC0415 - optional dependency
    except ImportError as e:
        raise ImportError(
            "export_tflite needs qlitert (LiteRT export); install it with "
            "`pip install 'jaxquant-qtorchlike[litert]'`"
        ) from e
    return qlitert


def _site_range(name: str, proxy: ActQuantProxy) -> tuple[float, float]:
    """The range LiteRT's int8 tensor gets so that its grid is the quantizer's.

    LiteRT's int8 activations are asymmetric with ``scale = (hi - lo) / 255``: a
    signed 8-bit quantizer with scale ``s`` is ``[-128 s, 127 s]`` (zero point 0),
    an unsigned one ``[0, 255 s]`` (zero point -128). Other types have no exact
    int8 equivalent: their clipping range is kept, on the int8 grid.
    """
    spec = proxy.spec
    s = float(_act_scale(proxy).reshape(()))  # per tensor: _refuse_unexportable checked
    if spec.quant_type is QuantType.INT and spec.bit_width == 8:
        return (-128 * s, 127 * s) if spec.signed else (0.0, 255 * s)
    if spec.quant_type is QuantType.INT:
        b = spec.bit_width
        lo = -(2 ** (b - 1)) + int(spec.narrow_range) if spec.signed else 0
        hi = 2 ** (b - 1) - 1 if spec.signed else 2**b - 1
    else:
        lo, hi = -spec.int_scaling, spec.int_scaling
    warnings.warn(
        f"export_tflite: activation quantizer {name!r} ({spec.name}, {spec.bit_width}-bit "
        f"{spec.quant_type.value}) has no int8 equivalent in LiteRT; it is exported as int8 "
        f"over its range [{lo * s:g}, {hi * s:g}]",
        stacklevel=3,
    )
    return lo * s, hi * s


# Ops whose output keeps its input's LiteRT scale (qlitert's list, which it extends).
_PRESERVING = {
    "reshape", "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice",
    "reduce_window_max", "copy", "copy_p", "broadcast_in_dim", "pad", "gather",
    "convert_element_type",
}  # fmt: skip


class _Sites:
    """Marks activation quantizers' outputs as LiteRT quantization sites.

    Each call of an enabled activation quantizer gets a forward hook that wraps
    its output in a one-operand concatenation under a named scope
    ``qtorchlike_act:<name>#<call>``: qlitert places a quantization site there
    (whose range :func:`export_tflite` then sets from the quantizer's scale), and
    the converter folds the concatenation away, so no op is added.

    A LiteRT tensor has one scale, and the converter cannot requantize between
    two int8 grids without a float round trip. So a quantizer whose input comes
    straight from another quantizer (through reshapes, pooling... only) is not
    marked: the tensor keeps the first quantizer's scale (:meth:`find_requantizing`).
    """

    def __init__(self) -> None:
        self.ranges: dict[str, tuple[float, float]] = {}
        self.skip: set[str] = set()
        self.calls: dict[str, int] = {}

    def hook(self, name: str) -> Any:
        def mark(proxy: Module, args: tuple, out: Any) -> Any:
            x = out.value if isinstance(out, QuantTensor) else out
            call = self.calls.get(name, 0)
            self.calls[name] = call + 1
            site = f"{name}#{call}"
            if jnp.ndim(x) == 0 or site in self.skip:
                return x
            with jax.named_scope(_SITE + site):
                return lax.concatenate_p.bind(jnp.asarray(x), dimension=0)

        return mark

    def find_requantizing(self, fn: Any, example: np.ndarray) -> None:
        """Adds to :attr:`skip` the marks whose input is another mark's output."""
        closed = jax.make_jaxpr(fn)(example)
        producer = {v: eqn for eqn in closed.jaxpr.eqns for v in eqn.outvars}
        for eqn in closed.jaxpr.eqns:
            site = _mark_of(eqn)
            if site is None:
                continue
            v = eqn.invars[0]
            while isinstance(v, jex.core.Var) and v in producer:
                source = producer[v]
                if _mark_of(source) is not None:
                    self.skip.add(site)
                    break
                if source.primitive.name not in _PRESERVING:
                    break
                v = source.invars[0]

    def override(self, ranges: dict[str, list[float]], site_key: Any) -> dict[str, list[float]]:
        """Calibrated ranges (one batch) with each mark's range set from its quantizer.

        qlitert puts a site of its own on the output of a computing op (an add, a
        concatenation, the model input...), so a mark on such a tensor follows a
        site on the same tensor. Both get the quantizer's range, which makes the
        two roundings one (the converter merges them into one as well). That
        site is the one just before the mark, with the same observed range.

        ``site_key`` is :class:`qlitert.SiteKey`, which reads the keys.
        """
        keys = sorted((site_key.parse(k) for k in ranges), key=lambda k: k.index)
        marks = [_mark_in(k.scopes) for k in keys]
        out = {k: list(v) for k, v in ranges.items()}
        for i, (key, mark) in enumerate(zip(keys, marks, strict=True)):
            if mark is None:
                continue
            site_range = list(self.ranges[mark.rpartition("#")[0]])
            out[str(key)] = site_range
            prev = str(keys[i - 1]) if i else None
            if prev is not None and marks[i - 1] is None and ranges[prev] == ranges[str(key)]:
                out[prev] = site_range
        return out


def _mark_in(scopes: Any) -> str | None:
    """The ``name#call`` of the mark among named scopes, if one is a mark."""
    for scope in scopes:
        if scope.startswith(_SITE):
            return scope[len(_SITE) :]
    return None


def _mark_of(eqn: Any) -> str | None:
    if eqn.primitive is not lax.concatenate_p or len(eqn.invars) != 1:
        return None
    return _mark_in(str(eqn.source_info.name_stack).split("/"))


def export_tflite(
    model: Module,
    example_input: Any,
    *,
    path: str | os.PathLike[str] | None = None,
    validate: bool = True,
    overwrite: bool = False,
) -> bytes:
    """Converts ``model`` to a full-integer LiteRT model (int8 kernels) with qlitert.

    The model runs in evaluation mode as a pure JAX function of its input, its
    state closed over: weights and biases enter as their quantized values
    (LiteRT stores weights per output channel, so a per-tensor weight scale is
    re-expressed per channel, an extra rounding on a grid at least as fine), and
    each enabled activation quantizer's scale becomes the scale of the int8
    tensor it quantizes (8-bit quantizers export exactly: a uint8 quantizer is
    int8 with zero point -128; other bit widths keep their range on the int8
    grid, with a warning). Tensors the model does not quantize but LiteRT must
    (the input, a layer's output without ``output_quant``) are calibrated by
    :func:`qlitert.calibrate` on ``example_input``. A LiteRT tensor has one
    scale, so a quantizer whose input another quantizer already quantized (a
    layer's ``input_quant`` right after a ``QuantReLU``, through reshapes or
    pooling only) is left out: the tensor keeps the first quantizer's scale, a
    difference of at most half a step of the one left out. The model is exported at
    the example's (static) shape and, with ``validate``, checked by qlitert:
    integer kernels only, every op within one step of the JAX function's.

    The model's modes, switches and state are as before afterwards, also when the
    export fails. Every argument is checked before converting. ``path`` is written
    only after a successful export, by :func:`qlitert.save`: atomically (a failure
    leaves the previous file as it was and no temporary behind). A ``.tflite``
    model already at ``path`` is replaced only with ``overwrite=True``; anything
    else there is never replaced (:func:`qlitert.check_path`, checked before
    converting).

    Args:
        model: The module, calibrated (see :func:`qtorchlike.calibration_mode`).
        example_input: One input batch (float32), e.g. ``(1, 1, 28, 28)``.
        path: Where to save the ``.tflite`` (optional).
        validate: Check the converted model (qlitert's validation).
        overwrite: Replace a ``.tflite`` model already at ``path``.

    Returns:
        The ``.tflite`` flatbuffer.

    Raises:
        ImportError: If qlitert is not installed (``pip install 'jaxquant-qtorchlike[litert]'``).
        TypeError: If ``model`` is not a :class:`qtorchlike.nn.Module`,
            ``example_input`` is not a numeric array with at least one dimension,
            ``path`` is not a path, or ``validate``/``overwrite`` is not a bool.
        ValueError: If ``example_input`` holds NaN or inf.
        FileNotFoundError: If ``path``'s directory does not exist.
        FileExistsError: If ``path`` holds a model and ``overwrite`` is not set, or
            holds anything else.
        qlitert.ExportError: If conversion or validation fails.

    Example:
        The executed version of this example is in the docs ("Coming from
        Brevitas", export); it needs qlitert, which qtorchlike does not::

            model = qnn.Sequential(qnn.QuantLinear(4, 8), qnn.QuantReLU(), qnn.QuantLinear(8, 2))
            with calibration_mode(model):
                model(x)
            tflite = export_tflite(model, x, path="model.tflite")
            y = qlitert.LiteRTModel(tflite)(x)  # close to model.eval()(x)
    """
    check_model(model, "export_tflite")
    for name, flag in (("validate", validate), ("overwrite", overwrite)):
        if not isinstance(flag, bool):
            raise TypeError(f"export_tflite({name}={flag!r}): {name} must be True or False")
    example = _example(example_input, "export_tflite")
    _refuse_unexportable(model)
    qlitert = _import_qlitert()
    if path is not None:  # before the conversion, to fail early
        qlitert.check_path(path, overwrite=overwrite)
    switches = Switches(model)
    before = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    handles = []
    try:
        model.eval()
        for p in proxies(model):
            if isinstance(p, ActQuantProxy):
                p.calibrating = False
        consts: dict[str, Any] = {}
        for name, layer in model.named_modules():
            if _quant_weighted(layer):
                wq = layer.quant_weight()
                if isinstance(wq, QuantTensor):
                    consts[_prefixed(name, "weight")] = wq.value
        for name, bq in _capture_biases(model, (example,)).items():
            consts[_prefixed(name, "bias")] = bq.value
        sites = _Sites()
        for name, proxy in model.named_modules():
            if isinstance(proxy, ActQuantProxy) and proxy.enabled:
                sites.ranges[name] = _site_range(name, proxy)
                handles.append(proxy.register_forward_hook(sites.hook(name)))
        for p in proxies(model):
            p.enabled = False
        switches.plain_outputs()

        def pure() -> Any:
            # A new function object each time: JAX caches traces per function, and
            # the marks depend on sites.skip.
            def fn(x: jax.Array) -> Any:
                sites.calls.clear()
                return functional_call(model, consts, x)[0]

            return fn

        sites.find_requantizing(pure(), example)
        fn = pure()
        calibration = qlitert.calibrate(fn, [example])
        calibration.ranges = sites.override(calibration.ranges, qlitert.SiteKey)
        tflite = qlitert.export(qlitert.annotate(fn, calibration), example, validate=validate)
    finally:
        for h in handles:
            h.remove()
        switches.restore()
        set_state(model, before)
    if path is not None:
        qlitert.save(path, tflite, overwrite=overwrite)
    return tflite


def _import_qort() -> Any:
    try:
        import qort  # noqa: PLC0415 - optional dependency
    except ImportError as e:
        raise ImportError(
            "export_onnx needs qort (ONNX Runtime export); install it with "
            "`pip install 'jaxquant-qtorchlike[onnx]'`"
        ) from e
    return qort


def _example(example_input: Any, fn: str) -> np.ndarray:
    """``example_input`` as a float32 (or integer) NumPy batch, checked."""
    try:
        example = np.asarray(example_input)
    except (TypeError, ValueError):  # ragged lists
        example = np.asarray(None)
    if example.ndim == 0 or not (
        np.issubdtype(example.dtype, np.number) or example.dtype == np.bool_
    ):
        raise TypeError(
            f"{fn}(example_input={type(example_input).__name__} of dtype "
            f"{example.dtype}, shape {example.shape}): give one input batch as an array "
            "(e.g. float32 of shape (1, 1, 28, 28)); the model is exported at its shape"
        )
    if np.issubdtype(example.dtype, np.floating):
        example = example.astype(np.float32)
    bad = int(example.size - np.count_nonzero(np.isfinite(example)))
    if bad:
        raise ValueError(
            f"{fn}(example_input of shape {example.shape}): {bad} non-finite "
            f"value{'s' if bad != 1 else ''} (NaN or inf) of {example.size}; allowed: finite "
            "values"
        )
    return example


# What export_onnx writes as ONNX's QDQ format: integer codes of at most 8 bits
# (activations, weights) and int32 biases.
_ONNX_ALLOWED = (
    "integer quantizers (IntQuant: Int8/Uint8/Int4... with per-tensor or per-channel "
    "scales, no zero point), at most 8 bits for weights and activations and 32 for biases"
)


def _refuse_for_onnx(model: Module) -> None:
    """Raises ValueError for what the QDQ export cannot express, naming layer and quantizer."""
    if model.training:
        raise ValueError(
            "export_onnx: the model is in training mode (model.training is True); call "
            "model.eval() first: the export traces the evaluation-mode forward, with the "
            "activation quantizers' calibrated scales"
        )
    for name, m in model.named_modules():
        for child, proxy in m.named_children():
            if not (isinstance(proxy, QuantProxy) and proxy.is_quant_enabled):
                continue
            spec = proxy.spec
            where = f"export_onnx: layer {name!r} has {child}={spec.name}"
            limit = 32 if child == "bias_quant" else 8
            wrong = None
            if spec.quant_type is not QuantType.INT:
                wrong = f"{spec.quant_type.value} codes"
            elif spec.bit_width > limit:
                wrong = f"{spec.bit_width}-bit codes"
            elif has_zero_point(spec):
                wrong = "a zero point"
            elif spec.rounding != "nearest_even":
                wrong = f"rounding {spec.rounding!r}"
            elif spec.per is ScalingPerOutputType.GROUP:
                wrong = "per-group scales"
            elif spec.quant_delay_steps:
                wrong = f"quant_delay_steps={spec.quant_delay_steps}"
            if wrong is not None:
                raise ValueError(f"{where} ({wrong}); allowed: {_ONNX_ALLOWED}")
            uncalibrated = "counter" in proxy._buffers and int(proxy.counter) == 0
            if isinstance(proxy, ActQuantProxy) and uncalibrated:
                raise ValueError(
                    f"{where}, which has seen no statistics (its scale is still its initial "
                    "value); calibrate first: run qtorchlike.calibration_mode("
                    "model) on a few batches, or train"
                )


def _code_range(spec: Any) -> tuple[int, int]:
    """The smallest and largest code of an integer quantizer."""
    b = int(spec.bit_width)
    if not spec.signed:
        return 0, 2**b - 1
    return -(2 ** (b - 1)) + int(spec.narrow_range), 2 ** (b - 1) - 1


def _codes_and_scale(qdq: Any, q: QuantTensor, what: str) -> tuple[np.ndarray, np.ndarray]:
    """``q``'s integer codes and scale, checked to give back its values exactly."""
    codes = _codes(q, what)
    scale = np.asarray(q.scale, np.float32)
    if scale.ndim == 1 and scale.size == codes.shape[0] > 1 and codes.ndim > 1:
        scale = scale.reshape((-1,) + (1,) * (codes.ndim - 1))  # Brevitas' per-channel (C,)
    if not np.array_equal(np.asarray(qdq.dequantize(codes, scale)), np.asarray(q.value)):
        raise ValueError(  # pragma: no cover - codes x scale is the quantizer's own product
            f"export_onnx: {what}: codes x scale differ from the quantized values"
        )
    return codes, scale


def export_onnx(
    model: Module,
    example_input: Any,
    *,
    path: str | os.PathLike[str] | None = None,
    validate: bool = True,
    overwrite: bool = False,
    threads: int | None = None,
) -> Any:
    """Exports ``model`` to ONNX in the QDQ format, so ONNX Runtime runs integer kernels.

    The model runs in evaluation mode as a pure JAX function of its input, traced by
    qort (``pip install "jaxquant-qtorchlike[onnx]"``):

    * each quantized weight becomes ``DequantizeLinear`` of its integer codes (the
      file holds the codes; int8 codes are stored as uint8 ``code + 128`` with zero
      point 128, the same values: ONNX Runtime's uint8 x int8 kernels saturate
      16-bit sums on x86 CPUs without VNNI);
    * a quantized bias (``Int32Bias``...) becomes ``DequantizeLinear`` of int32 codes;
    * each enabled activation quantizer (``input_quant``, ``output_quant``,
      ``QuantReLU``, ``QuantIdentity``...) becomes ``QuantizeLinear`` → (``Clip`` for
      fewer than 8 bits or a narrow range) → ``DequantizeLinear`` with its
      calibrated scale (:func:`qort.qdq.quantize_dequantize`), its JAX value being
      qtorchlike's own fake quantization.

    ONNX Runtime's optimizer fuses ``DequantizeLinear`` → ``Conv`` / ``MatMul`` /
    ``Gemm`` (→ ``QuantizeLinear``) into ``QLinearConv``, ``QLinearMatMul``,
    ``QGemm``, ``MatMulIntegerToFloat``; the validation report counts the products
    between a quantized activation and a quantized weight and names those it left
    as float ops (``unfused_products``: a convolution whose output is not quantized
    stays a float ``Conv``). With ``validate``, qort checks every op against JAX
    (:mod:`qort.validation`): codes equal JAX's or, at a rounding tie, differ by one
    step (counted in ``report.qdq_steps``).

    The model's modes, switches and state are as before afterwards, also when the
    export fails. ``path`` is written only after a successful export, atomically; an
    existing file is replaced only with ``overwrite=True``.

    Args:
        model: The module in evaluation mode (``model.eval()``), calibrated (see
            :func:`qtorchlike.calibration_mode`) or trained.
        example_input: One input batch (float32); the graph has its (static) shape.
        path: Where to save the ``.onnx`` (optional).
        validate: Validate the graph op by op against JAX (:mod:`qort.validation`).
        overwrite: Replace a file already at ``path``.
        threads: ONNX Runtime threads for validation.

    Returns:
        A :class:`qort.Exported` (``.model``, ``.report``, ``.save``; run it with
        :class:`qort.Session`).

    Raises:
        ImportError: If qort is not installed.
        TypeError: If ``model`` is not a :class:`qtorchlike.nn.Module` or
            ``example_input`` is not a numeric array.
        ValueError: If the model is in training mode, an activation quantizer has
            seen no statistics, a quantizer is not an integer one of at most 8 bits
            without zero point (32 for biases) with per-tensor or per-channel scales
            (the message names layer, quantizer and what is allowed), or
            ``example_input`` holds NaN or inf.
        FileExistsError: If ``path`` exists and ``overwrite`` is not set.
        qort.ExportError: If an op has no ONNX lowering.
        qort.ValidationError: If the graph disagrees with JAX.

    Example:
        The executed version is in the docs ("Deploy to ONNX Runtime", qtorchlike);
        it needs qort, which qtorchlike does not::

            model = qnn.Sequential(qnn.QuantIdentity(), qnn.QuantLinear(4, 8), ...)
            with calibration_mode(model):
                model(x)
            exported = export_onnx(model.eval(), x, path="model.onnx")
            y = qort.Session(exported)(x)  # close to model(x)
    """
    check_model(model, "export_onnx")
    for flag_name, flag in (("validate", validate), ("overwrite", overwrite)):
        if not isinstance(flag, bool):
            raise TypeError(f"export_onnx({flag_name}={flag!r}): {flag_name} must be True or False")
    example = _example(example_input, "export_onnx")
    _refuse_for_onnx(model)
    _refuse_truncation(model, (example,))
    qort = _import_qort()
    qdq = qort.qdq
    if path is not None and os.path.isdir(os.path.expanduser(path)):
        raise ValueError(f"export_onnx(path={str(path)!r}) is a directory; allowed: a file path")
    if path is not None and os.path.exists(os.path.expanduser(path)) and not overwrite:
        raise FileExistsError(
            f"export_onnx(path={str(path)!r}): the file exists; pass overwrite=True to replace it"
        )
    switches = Switches(model)
    before = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    handles = []
    scopes: list[Any] = []
    try:
        for p in proxies(model):
            if isinstance(p, ActQuantProxy):
                p.calibrating = False
        quantized: dict[str, QuantTensor] = {}
        for name, layer in model.named_modules():
            if _quant_weighted(layer):
                wq = layer.quant_weight()
                if isinstance(wq, QuantTensor):
                    quantized[_prefixed(name, "weight")] = wq
        for name, bq in _capture_biases(model, (example,)).items():
            quantized[_prefixed(name, "bias")] = bq
        weights = {k: _codes_and_scale(qdq, q, f"param {k!r}") for k, q in quantized.items()}

        def mark(proxy: ActQuantProxy) -> Any:
            scale = np.asarray(_act_scale(proxy), np.float32)
            qmin, qmax = _code_range(proxy.spec)

            def reference(x: jax.Array, s: jax.Array, _z: jax.Array) -> jax.Array:
                return proxy._quantize(x, s).value

            def hook(_proxy: Module, _args: tuple, out: Any) -> Any:
                x = out.value if isinstance(out, QuantTensor) else out
                return qdq.quantize_dequantize(x, scale, qmin=qmin, qmax=qmax, reference=reference)

            return hook

        for proxy in proxies(model):
            if isinstance(proxy, ActQuantProxy) and proxy.is_quant_enabled:
                handles.append(proxy.register_forward_hook(mark(proxy)))
        # Each module's ops are traced under a named scope of its name, so the
        # validation report names the layer ("Conv in 1/...").

        def enter(name: str) -> Any:
            def hook(_m: Module, _args: tuple) -> None:
                scope = jax.named_scope(name)
                scope.__enter__()
                scopes.append(scope)

            return hook

        def leave(_m: Module, _args: tuple, _out: Any) -> None:
            scopes.pop().__exit__(None, None, None)

        for name, m in model.named_modules():
            if name:
                handles.append(m.register_forward_pre_hook(enter(name.rpartition(".")[2])))
                handles.append(m.register_forward_hook(leave))
        for p in proxies(model):
            p.enabled = False
        switches.plain_outputs()

        def fn(x: jax.Array) -> Any:
            consts = {k: qdq.dequantize(c, s) for k, (c, s) in weights.items()}
            return functional_call(model, consts, x)[0]

        exported = qort.export_function(
            fn,
            example,
            input_names=["input"],
            output_names=["output"],
            validate=validate,
            threads=threads,
        )
    finally:
        while scopes:  # a forward that raised left its scopes open
            scopes.pop().__exit__(None, None, None)
        for h in handles:
            h.remove()
        switches.restore()
        set_state(model, before)
    if path is not None:
        exported.save(path, overwrite=overwrite)
    return exported
