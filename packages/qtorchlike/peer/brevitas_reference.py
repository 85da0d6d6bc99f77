"""Reference outputs of real Brevitas for qtorchlike's parity tests.

Runs only in an environment with torch and Brevitas, never in qtorchlike's own
(the tests read what it writes with NumPy alone). From the repository root::

    nox -s brevitas_reference

which makes a venv with the pinned ``torch`` and ``brevitas`` (see noxfile.py) and
runs this file. By hand, in any venv holding them::

    python packages/qtorchlike/peer/brevitas_reference.py [OUT_DIR]

It writes ``brevitas_reference.npz`` (every array, float32, in the shapes Brevitas
returns, 0-d included) and ``brevitas_reference.json`` (versions, date, platform,
the behaviours worth knowing, and per case: quantizer, layer, keyword arguments,
the sequence of calls with their modes, and the array keys and shapes of what was
recorded) into ``OUT_DIR``, by default ``packages/qtorchlike/tests/fixtures``.

All inputs come from one seeded NumPy generator and are stored with the outputs,
so the tests feed qtorchlike exactly what Brevitas saw. Nothing here draws from
torch's random generator: layers get their weights and biases copied in before
their first call.
"""

from __future__ import annotations

import datetime
import importlib
import json
import math
import platform
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import numpy as np

SEED = 20250829
# Shapes of the stored inputs (kept small: the .npz stays well under 2 MB).
CONV = {"args": [8, 16, 3], "weight": (16, 8, 3, 3), "x": (4, 8, 6, 6)}
LINEAR = {"args": [64, 32], "weight": (32, 64), "x": (4, 64)}
ACT_SHAPE = (4, 8, 6, 6)
TRAIN_STEPS = 5  # training calls in each activation case before the eval call
WEIGHT_QUANTS = [
    "Int8WeightPerTensorFloat",
    "Int8WeightPerChannelFloat",
    "Int8WeightPerTensorFixedPoint",
    "Int8WeightPerChannelFixedPoint",
    "Int4WeightPerChannelFloat",
    "SignedBinaryWeightPerTensorConst",
    "SignedTernaryWeightPerTensorConst",
    "Fp8e4m3OCPWeightPerTensorFloat",
    "Fp8e5m2OCPWeightPerTensorFloat",
    "ShiftedUint8WeightPerTensorFloat",
    "ShiftedUint8WeightPerChannelFloat",
    "Int8WeightPerTensorFloatMSE",
    "Int8WeightPerChannelFloatMSE",
    "ShiftedUint8WeightPerTensorFloatMSE",
    "ShiftedUint8WeightPerChannelFloatMSE",
]
# Weight quantizers also run at 4 bits (weight_bit_width=4).
WEIGHT_4BIT = [
    "Int8WeightPerTensorFloat",
    "Int8WeightPerChannelFloat",
    "Int8WeightPerTensorFixedPoint",
    "Int8WeightPerChannelFixedPoint",
]
# Activation quantizers whose scale comes from runtime statistics (collect_stats_steps
# applies), with whether they are unsigned (then also run after a ReLU).
RUNTIME_ACT_QUANTS = {
    "Int8ActPerTensorFloat": False,
    "Uint8ActPerTensorFloat": True,
    "Int8ActPerTensorFixedPoint": False,
    "Uint8ActPerTensorFixedPoint": True,
    "ShiftedUint8ActPerTensorFloat": True,
    "ShiftedUint8ActPerTensorFixedPoint": True,
    "Int8ActPerTensorFloatMSE": False,
    "Uint8ActPerTensorFloatMSE": True,
    "ShiftedUint8ActPerTensorFloatMSE": True,
    "Fp8e4m3OCPActPerTensorFloat": False,
    "Fp8e5m2OCPActPerTensorFloat": False,
}
# Activation quantizers with a learned scale from min_val/max_val, or a constant one,
# and the keyword arguments they need.
OTHER_ACT_QUANTS = {
    "Int8ActPerTensorFloatMinMaxInit": ({"min_val": -1.5, "max_val": 2.0}, False),
    "Uint8ActPerTensorFloatMaxInit": ({"max_val": 2.5}, True),
    "SignedBinaryActPerTensorConst": ({}, False),
    "SignedTernaryActPerTensorConst": ({}, False),
}
# Activation quantizers also run at 4 bits (bit_width=4, collect_stats_steps=3).
ACT_4BIT = [
    "Int8ActPerTensorFloat",
    "Uint8ActPerTensorFloat",
    "Int8ActPerTensorFixedPoint",
    "Uint8ActPerTensorFixedPoint",
    "Int8ActPerTensorFloatMinMaxInit",
    "Uint8ActPerTensorFloatMaxInit",
    "ShiftedUint8ActPerTensorFloat",
    "Int8ActPerTensorFloatMSE",
]

# What the Brevitas sources (brevitas 0.13.4, paths under brevitas/) say about the
# behaviours these cases pin down; the script checks the checkable ones as it runs.
NOTES = {
    "percentile": (
        "core/stats/stats_op.py AbsPercentile: k = floor(0.01 * q * numel + 0.5), then "
        "kthvalue(|x|.view(-1), k) (1-indexed): the nearest rank, no interpolation. For "
        "q=99.999: 1152 values -> k=1152 (the max), 16x512 -> k=8192 (the max), "
        "16x4096 -> k=65535 (the second largest). Checked against np.sort here."
    ),
    "running_stats": (
        "core/scaling/standalone.py ParameterFromRuntimeStatsScaling: training calls "
        "0..collect_stats_steps-1 return the batch statistic (clamped to scaling_min_val "
        "1e-10) divided by the integer threshold, WITHOUT restrict_scaling (so a "
        "power-of-two quantizer's scale is not a power of two while collecting); the buffer "
        "starts at the first statistic, then buffer = 0.9 * buffer + 0.1 * stat "
        "(core/utils.py inplace_momentum_update). Call number collect_stats_steps copies the "
        "buffer into the learned value (log2 of it for power-of-two scales) and uses it. "
        "Eval before that uses the buffer (restricted), after it the value."
    ),
    "scale_shapes": (
        "Per-tensor int and fp8 scales are 0-d, per-channel ones (out,1,1,1) for conv and "
        "(out,1) for linear; constant scales of binary quantizers are shape (1,) "
        "(ConstScaling/ParameterScaling divide by a threshold torch.ones(1)), of ternary "
        "ones 0-d. Zero points are 0-d except ShiftedUint8WeightPerChannelFloat, whose zero "
        "point has the scale's shape. Bit widths are 0-d."
    ),
    "zero_point": (
        "core/zero_point.py: ShiftedMinUint weight zero point = round(-min(min(w), 0) / "
        "scale) with NegativeMinOrZero stats; ShiftedParamFromPercentileUint act zero point "
        "from the 0.001 low percentile (k = ceil(0.01 * q * numel)) clamped to <= 0, "
        "collected like the scale (ParameterFromRuntimeZeroPoint); the QuantTensor holds "
        "the integer zero point, value = (clamp(round(x / scale + zp)) - zp) * scale. "
        "Their scale statistic is PercentileInterval (high - min(low, 0))."
    ),
    "mse": (
        "quant/base.py MSESymmetricScale / core/stats/stats_op.py MSE: scaling "
        "PARAMETER_FROM_STATS whose statistic is a grid search (mse_search_method 'grid', "
        "mse_iters 20) over candidates init/20 + (init - init/20) * t, t = linspace(1/19, "
        "1, 19), init = max|x| (AbsMax; AbsMinMax for the asymmetric Shifted ones, whose "
        "zero point is searched the same way from NegativeMinOrZero), keeping the first "
        "candidate with the smallest sum of squared quantization error. Weights search once, "
        "on the first call (ParameterFromStatsFromParameterScaling); activations every "
        "collection step, then the running average is learned."
    ),
    "per_channel_act": (
        "quant/solver/act.py: per-channel activation scaling needs "
        "scaling_per_output_channel=True (or scaling_per_output_type='CHANNEL'), "
        "per_channel_broadcastable_shape (the scale's shape, from SolveActScalingShape) AND "
        "scaling_stats_permute_dims (SolveScalingStatsInputViewShapeImplFromEnum."
        "permute_dims has no default); see the 'probes' entry for the errors without them."
    ),
    "const_relu": (
        "quant/solver/act.py SolveActScalingInitFromEnum: scaling_impl_type CONST or "
        "PARAMETER takes scaling_init from MinMaxScalingInit = max(|min_val|, |max_val|), "
        "min_val defaulting to 0 for unsigned quantizers; so QuantReLU(max_val=6, "
        "scaling_impl_type='CONST') has the constant scale 6/255."
    ),
    "he": (
        "quant/solver/act.py SolveActScalingImplFromEnum raises RuntimeError('HE not "
        "supported.') for activations; for weights (quant/solver/parameter.py) HE is a "
        "ConstScaling initialised by HeScalingInit = mean over tracked weights of "
        "sqrt(2 / fan_in), fan_in = weight.view(out, -1).shape[1]."
    ),
    "quant_delay_steps": (
        "core/quant/delay.py _DelayQuant: the first quant_delay_steps calls return the "
        "input unquantized (still wrapped in a QuantTensor with the scale computed that "
        "call), counting down on every call, in training AND in eval mode; statistics are "
        "collected during those calls all the same."
    ),
    "binary": (
        "core/quant/binary.py: BinaryQuant gives binary_sign(x) * scale (sign(0) = +1); "
        "ClampedBinaryQuant first clamps x to [-scale, scale] (only gradients differ). "
        "Both return (value, scale, zero_point=0-d 0., bit_width=0-d 1.)."
    ),
    "fp8": (
        "FloatQuantTensor has no bit_width; the fixtures' bit_width of fp8 cases is "
        "1 + exponent_bit_width + mantissa_bit_width (stored with exponent_bit_width, "
        "mantissa_bit_width and exponent_bias). OCP e4m3's largest value is 448."
    ),
    "lookup": (
        "Quantizers are taken from brevitas.quant when exported there, else from the "
        "brevitas.quant submodule defining them (Int8WeightPerChannelFixedPoint is defined "
        "in brevitas.quant.fixed_point but missing from its __all__)."
    ),
}


def _rng_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every input array, drawn in a fixed order from ``rng`` (float32)."""

    def normal(shape: tuple[int, ...], std: Any = 1.0, mean: float = 0.0) -> np.ndarray:
        return (rng.standard_normal(shape) * std + mean).astype(np.float32)

    out: dict[str, np.ndarray] = {}
    # Weights whose output channels differ in magnitude, so per-channel scales differ.
    out["w_conv"] = normal(CONV["weight"], 0.1 * np.linspace(0.25, 2.0, 16)[:, None, None, None])
    out["b_conv"] = normal((16,), 0.1)
    out["x_conv"] = normal(CONV["x"])
    out["w_linear"] = normal(LINEAR["weight"], 0.1 * np.linspace(0.25, 2.0, 32)[:, None])
    out["b_linear"] = normal((32,), 0.1)
    out["x_linear"] = normal(LINEAR["x"])
    # Activation batches: growing spread and a drifting mean, so statistics move.
    for i in range(TRAIN_STEPS):
        out[f"x_act_{i}"] = normal(ACT_SHAPE, 1.0 + 0.3 * i, 0.1 * i)
    out["x_act_eval"] = normal(ACT_SHAPE, 1.5)
    for i in range(3):
        out[f"x_linear_{i}"] = normal(LINEAR["x"], 1.0 + 0.3 * i, 0.1 * i)
    out["x_linear_eval"] = normal(LINEAR["x"], 1.5)
    out["x_wide"] = normal(ACT_SHAPE, 4.0)  # exceeds QuantReLU(max_val=6)'s range
    # Heavy tails separate the top order statistics (the percentile cases).
    out["x_p512"] = rng.standard_t(3, (16, 512)).astype(np.float32)
    out["x_p4096"] = rng.standard_t(3, (16, 4096)).astype(np.float32)
    # Exact rounding ties (x / scale = n + 1/2 in float32) for the fixed scales: 0.1 of
    # the ternary weight quantizer, 1/64 of Int8ActPerTensorFloatMinMaxInit at 8 bits
    # (max_val 2 / 128) and 1 of the ternary activation quantizer.
    out["w_linear"][0, :4] = [0.05, -0.05, 0.05, -0.05]
    out["w_conv"][0, 0, 0, :] = [0.05, -0.05, 0.05]
    ties = np.float32([(k + 0.5) / 64 for k in range(-8, 8)] + [0.5, -0.5, 1.5, -1.5])
    out["x_act_eval"].reshape(-1)[: ties.size] = ties
    # For the tensor_quant cases: zeros, values inside and outside +-scale (0.1).
    special = [0.0, -0.0, 0.04, -0.04, 0.1, -0.1, 0.6, -0.6, 3.3, -3.3, 1e-8, -1e-8]
    out["x_binary"] = np.concatenate([np.float32(special), normal((20,), 0.3)]).astype(np.float32)
    return out


class Recorder:
    """Collects arrays (by key) and case descriptions."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self.cases: list[dict[str, Any]] = []
        self.skipped: list[dict[str, str]] = []
        self.probes: list[dict[str, str]] = []

    def put(self, key: str, value: Any) -> str:
        """Stores ``value`` as float32 under ``key`` (a fresh key) and returns the key."""
        import torch

        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        arr = np.asarray(value, dtype=np.float32)
        if key in self.arrays:
            raise KeyError(f"duplicate array key {key!r}")
        self.arrays[key] = arr
        return key

    def shapes(self, keys: dict[str, Any]) -> dict[str, list[int]]:
        """The shapes of the arrays named in ``keys`` (values that are keys)."""
        out = {}
        for v in keys.values():
            if isinstance(v, str) and v in self.arrays:
                out[v] = list(self.arrays[v].shape)
        return out


def _find_quant(name: str) -> tuple[Any, str] | None:
    """Brevitas' quantizer class called ``name`` and the module it was taken from."""
    import brevitas.quant as bq

    if name in vars(bq):
        return vars(bq)[name], "brevitas.quant"
    for sub in (
        "scaled_int",
        "fixed_point",
        "shifted_scaled_int",
        "binary",
        "ternary",
        "float",
        "float_quant_ocp",
    ):
        module = importlib.import_module(f"brevitas.quant.{sub}")
        if name in vars(module):
            return vars(module)[name], module.__name__
    return None


def _qt_record(rec: Recorder, prefix: str, qt: Any) -> dict[str, Any]:
    """Stores a QuantTensor's fields under ``prefix/...``.

    Args:
        rec: Where the arrays go.
        prefix: Key prefix of the fields.
        qt: Brevitas' IntQuantTensor or FloatQuantTensor.

    Returns:
        The fields' array keys (value, scale, zero_point, bit_width and, for
        minifloats, exponent_bit_width, mantissa_bit_width, exponent_bias), the
        tensor's type name, ``signed`` and ``training``.
    """
    from brevitas.quant_tensor import FloatQuantTensor

    desc: dict[str, Any] = {"type": type(qt).__name__}
    desc["value"] = rec.put(f"{prefix}/value", qt.value)
    desc["scale"] = rec.put(f"{prefix}/scale", qt.scale)
    desc["zero_point"] = rec.put(f"{prefix}/zero_point", qt.zero_point)
    if isinstance(qt, FloatQuantTensor):
        e, m = qt.exponent_bit_width, qt.mantissa_bit_width
        desc["bit_width"] = rec.put(f"{prefix}/bit_width", 1 + e + m)
        desc["exponent_bit_width"] = rec.put(f"{prefix}/exponent_bit_width", e)
        desc["mantissa_bit_width"] = rec.put(f"{prefix}/mantissa_bit_width", m)
        desc["exponent_bias"] = rec.put(f"{prefix}/exponent_bias", qt.exponent_bias)
    else:
        desc["bit_width"] = rec.put(f"{prefix}/bit_width", qt.bit_width)
    signed = qt.signed
    desc["signed"] = None if signed is None else bool(signed)
    desc["training"] = bool(qt.training)
    return desc


def _copy_params(layer: Any, weight: np.ndarray, bias: np.ndarray) -> None:
    """Copies ``weight`` and ``bias`` into ``layer`` before its first call."""
    import torch

    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(weight))
        layer.bias.copy_(torch.from_numpy(bias))
    # Statistics-initialised scales must not have been computed from the old weights.
    for m in layer.modules():
        if getattr(m, "init_done", False):
            raise RuntimeError(f"{type(m).__name__} initialised before the weights were set")


def weight_case(rec: Recorder, quant: str, kind: str, kwargs: dict) -> None:
    """One weight quantizer on one layer (eval): quant_weight() and the layer's output.

    Args:
        rec: Where arrays and the case description go.
        quant: The ``weight_quant`` by name (nothing is recorded if Brevitas lacks it).
        kind: ``"conv"`` (QuantConv2d(8, 16, 3)) or ``"linear"`` (QuantLinear(64, 32)).
        kwargs: Extra keyword arguments of the layer (``weight_bit_width=4``...).
    """
    import brevitas.nn as qnn
    import torch

    found = _find_quant(quant)
    if found is None:
        return
    q, module = found
    spec = CONV if kind == "conv" else LINEAR
    layer_name = "QuantConv2d" if kind == "conv" else "QuantLinear"
    suffix = "".join(f"/{k}={v}" for k, v in kwargs.items())
    name = f"weight/{quant}{suffix}/{kind}"
    layer = getattr(qnn, layer_name)(*spec["args"], weight_quant=q, **kwargs)
    w, b, x = f"inputs/w_{kind}", f"inputs/b_{kind}", f"inputs/x_{kind}"
    _copy_params(layer, rec.arrays[w], rec.arrays[b])
    layer.eval()
    with torch.no_grad():
        qw = _qt_record(rec, f"{name}/quant_weight", layer.quant_weight())
        out = rec.put(f"{name}/output", layer(torch.from_numpy(rec.arrays[x])))
    keys = {k: v for k, v in qw.items() if isinstance(v, str) and v.startswith(name)}
    rec.cases.append(
        {
            "name": name,
            "kind": "weight",
            "quantizer": quant,
            "brevitas_module": module,
            "layer": layer_name,
            "layer_args": spec["args"],
            "quant_args": {"weight_quant": quant},
            "kwargs": kwargs,
            "mode": "eval",
            "inputs": {"weight": w, "bias": b, "x": x},
            "quant_weight": qw,
            "output": out,
            "shapes": rec.shapes({**keys, "output": out, "w": w, "b": b, "x": x}),
        }
    )


def act_case(
    rec: Recorder,
    name: str,
    layer_name: str,
    quant: str | None,
    kwargs: dict,
    train_inputs: list[str],
    eval_input: str | None,
    record: list[int] | None = None,
    notes: str = "",
) -> None:
    """An activation layer trained on ``train_inputs`` (one call each), then evaluated.

    Args:
        rec: Where arrays and the case description go.
        name: The case's name (and the prefix of its array keys).
        layer_name: ``QuantIdentity`` or ``QuantReLU``.
        quant: The ``act_quant`` by name (None: the layer's default).
        kwargs: The layer's other keyword arguments (JSON-friendly: lists for tuples).
        train_inputs: Input keys, one training call each, in order.
        eval_input: Input key of the final eval call (None: no eval call).
        record: The training calls whose outputs are stored (None: all); the eval
            call's output is always stored.
        notes: Free text kept with the case.
    """
    import brevitas.nn as qnn
    import torch

    quant_args: dict[str, str] = {}
    layer_kwargs = dict(kwargs)
    module = None
    if quant is not None:
        found = _find_quant(quant)
        if found is None:
            return
        layer_kwargs["act_quant"], module = found
        quant_args["act_quant"] = quant
    layer_kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in layer_kwargs.items()}
    layer = getattr(qnn, layer_name)(return_quant_tensor=True, **layer_kwargs)
    steps: list[dict[str, Any]] = []
    calls = [("train", x) for x in train_inputs]
    if eval_input is not None:
        calls.append(("eval", eval_input))
    for i, (mode, x) in enumerate(calls):
        layer.train(mode == "train")
        with torch.no_grad():
            y = layer(torch.from_numpy(rec.arrays[x]))
        step: dict[str, Any] = {"call": i, "mode": mode, "input": x}
        if mode == "eval" or record is None or i in record:
            step["output"] = _qt_record(rec, f"{name}/call{i}", y)
        steps.append(step)
    keys = {
        f"{s['call']}/{k}": v for s in steps for k, v in s.get("output", {}).items() if k != "type"
    }
    case = {
        "name": name,
        "kind": "act",
        "quantizer": quant,
        "brevitas_module": module,
        "layer": layer_name,
        "quant_args": quant_args,
        "kwargs": kwargs,
        "mode": f"train x{len(train_inputs)}" + (" then eval" if eval_input else ""),
        "steps": steps,
        "shapes": rec.shapes({**keys, **{f"in{i}": x for i, (_, x) in enumerate(calls)}}),
    }
    if notes:
        case["notes"] = notes
    rec.cases.append(case)


def layer_case(
    rec: Recorder, name: str, kind: str, quant_args: dict[str, str], train: int, notes: str
) -> None:
    """A weight layer with quantized input, bias (and output): ``train`` calls, then eval.

    Also stores what the output quantizer was fed (the float accumulator), so the tests
    can tell rounding ties.

    Args:
        rec: Where arrays and the case description go.
        name: The case's name (and the prefix of its array keys).
        kind: ``"conv"`` or ``"linear"``.
        quant_args: ``input_quant``, ``bias_quant``... by quantizer name.
        train: Number of training calls before the eval call.
        notes: Free text kept with the case.
    """
    import brevitas.nn as qnn
    import torch

    spec = CONV if kind == "conv" else LINEAR
    layer_name = "QuantConv2d" if kind == "conv" else "QuantLinear"
    resolved = {}
    for arg, quant in quant_args.items():
        found = _find_quant(quant)
        if found is None:
            return
        resolved[arg] = found[0]
    layer = getattr(qnn, layer_name)(*spec["args"], return_quant_tensor=True, **resolved)
    w, b = f"inputs/w_{kind}", f"inputs/b_{kind}"
    _copy_params(layer, rec.arrays[w], rec.arrays[b])
    fed: list[Any] = []
    if "output_quant" in quant_args:
        layer.output_quant.register_forward_pre_hook(
            lambda _m, args: fed.append(getattr(args[0], "value", args[0]))
        )
    xs = [f"inputs/x_act_{i}" if kind == "conv" else f"inputs/x_linear_{i}" for i in range(train)]
    calls = [("train", x) for x in xs]
    calls.append(("eval", "inputs/x_act_eval" if kind == "conv" else "inputs/x_linear_eval"))
    steps = []
    for i, (mode, x) in enumerate(calls):
        layer.train(mode == "train")
        fed.clear()
        with torch.no_grad():
            y = layer(torch.from_numpy(rec.arrays[x]))
        step: dict[str, Any] = {"call": i, "mode": mode, "input": x}
        step["output"] = _qt_record(rec, f"{name}/call{i}", y)
        if fed:
            step["output_quant_input"] = rec.put(f"{name}/call{i}/output_quant_input", fed[0])
        steps.append(step)
    keys = {}
    for s in steps:
        keys.update({f"{s['call']}/{k}": v for k, v in s["output"].items() if k != "type"})
        keys[f"{s['call']}/output_quant_input"] = s.get("output_quant_input")
    rec.cases.append(
        {
            "name": name,
            "kind": "layer",
            "quantizer": None,
            "layer": layer_name,
            "layer_args": spec["args"],
            "quant_args": quant_args,
            "kwargs": {"return_quant_tensor": True},
            "mode": f"train x{train} then eval",
            "inputs": {"weight": w, "bias": b},
            "steps": steps,
            "shapes": rec.shapes({**keys, "w": w, "b": b}),
            "notes": notes,
        }
    )


def tensor_quant_case(rec: Recorder, impl: str) -> None:
    """``Q.tensor_quant(x)`` of an injector with ``tensor_quant = impl`` (the notebook's)."""
    import torch
    from brevitas.core import quant as core_quant
    from brevitas.core.scaling import ParameterScaling
    from brevitas.inject import ExtendedInjector

    q = type(
        f"My{impl}Quantizer",
        (ExtendedInjector,),
        {
            "tensor_quant": getattr(core_quant, impl),
            "scaling_impl": ParameterScaling,
            "scaling_init": 0.1,
        },
    )
    name = f"tensor_quant/{impl}"
    x = "inputs/x_binary"
    with torch.no_grad():
        out = q.tensor_quant(torch.from_numpy(rec.arrays[x]))
    keys = {
        field: rec.put(f"{name}/{field}", t)
        for field, t in zip(("value", "scale", "zero_point", "bit_width"), out, strict=True)
    }
    rec.cases.append(
        {
            "name": name,
            "kind": "tensor_quant",
            "quantizer": None,
            "tensor_quant": impl,
            "injector": {
                "tensor_quant": impl,
                "scaling_impl": "ParameterScaling",
                "scaling_init": 0.1,
            },
            "mode": "direct call Q.tensor_quant(x)",
            "input": x,
            "output": keys,
            "shapes": rec.shapes({**keys, "x": x}),
        }
    )


def _probe(rec: Recorder, what: str, fn: Any) -> bool:
    """Runs ``fn``; records whether Brevitas accepted ``what`` (and its error if not)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - any refusal is the finding
        rec.probes.append({"call": what, "result": f"{type(e).__name__}: {e}"})
        return False
    rec.probes.append({"call": what, "result": "accepted"})
    return True


def _check_percentile(rec: Recorder, case_name: str, x_key: str, int_scaling: float) -> int:
    """Asserts the recorded scale is the nearest-rank percentile; returns k."""
    x = rec.arrays[x_key]
    k = int(math.floor(0.01 * 99.999 * x.size + 0.5))
    kth = np.sort(np.abs(x).ravel())[k - 1]
    scale = float(rec.arrays[f"{case_name}/call0/scale"])
    if not math.isclose(scale * int_scaling, float(kth), rel_tol=1e-6):
        raise AssertionError(f"{case_name}: scale*{int_scaling} != |x|_({k}) = {kth}")
    return k


def build(rec: Recorder) -> None:
    """Runs every case."""
    import brevitas.nn as qnn
    import torch

    inputs = _rng_inputs(np.random.default_rng(SEED))
    for key, arr in inputs.items():
        rec.put(f"inputs/{key}", arr)
    acts = [f"inputs/x_act_{i}" for i in range(TRAIN_STEPS)]

    # Which requested names Brevitas lacks.
    wanted = [
        *WEIGHT_QUANTS,
        *RUNTIME_ACT_QUANTS,
        *OTHER_ACT_QUANTS,
        "Int32Bias",
        "Int8Bias",
        "Int16Bias",
        "Int24Bias",
        "Int8BiasPerTensorFloatInternalScaling",
    ]
    for quant in wanted:
        if _find_quant(quant) is None:
            rec.skipped.append({"name": quant, "reason": "Brevitas 0.13.4 has no such quantizer"})

    # -- weights ---------------------------------------------------------------------
    for kind in ("conv", "linear"):
        for quant in WEIGHT_QUANTS:
            weight_case(rec, quant, kind, {})
        for quant in WEIGHT_4BIT:
            weight_case(rec, quant, kind, {"weight_bit_width": 4})
        weight_case(
            rec, "Int8WeightPerTensorFloat", kind, {"weight_scaling_per_output_channel": True}
        )
        weight_case(rec, "Int8WeightPerTensorFloat", kind, {"weight_scaling_impl_type": "HE"})
        # A learned per-channel scale initialised from max|w_c| (qtorchlike's
        # Int8WeightPerChannelFloatLSQ is this quantizer under one name).
        weight_case(
            rec,
            "Int8WeightPerChannelFloat",
            kind,
            {"weight_scaling_impl_type": "parameter_from_stats"},
        )

    # -- activations -----------------------------------------------------------------
    for quant, unsigned in RUNTIME_ACT_QUANTS.items():
        layers = ["QuantIdentity", "QuantReLU"] if unsigned else ["QuantIdentity"]
        for layer in layers:
            short = "identity" if layer == "QuantIdentity" else "relu"
            # Default collect_stats_steps (300): every call collects statistics.
            act_case(
                rec,
                f"act/{quant}/{short}/default",
                layer,
                quant,
                {},
                acts,
                "inputs/x_act_eval",
                record=[0, 1, TRAIN_STEPS - 1],
            )
            # collect_stats_steps=3: calls 0-2 collect, call 3 hands over to the value.
            act_case(
                rec,
                f"act/{quant}/{short}/collect_stats_steps=3",
                layer,
                quant,
                {"collect_stats_steps": 3},
                acts,
                "inputs/x_act_eval",
            )
    for quant, (kw, unsigned) in OTHER_ACT_QUANTS.items():
        layers = ["QuantIdentity", "QuantReLU"] if unsigned else ["QuantIdentity"]
        for layer in layers:
            short = "identity" if layer == "QuantIdentity" else "relu"
            act_case(rec, f"act/{quant}/{short}", layer, quant, kw, acts, "inputs/x_act_eval")
    for quant in ACT_4BIT:
        kw = dict(OTHER_ACT_QUANTS.get(quant, ({}, False))[0])
        if quant in RUNTIME_ACT_QUANTS:
            kw["collect_stats_steps"] = 3
        kw["bit_width"] = 4
        suffix = "".join(
            f"/{k}={v}" for k, v in kw.items() if k in ("bit_width", "collect_stats_steps")
        )
        act_case(
            rec,
            f"act/{quant}/identity{suffix}",
            "QuantIdentity",
            quant,
            kw,
            acts,
            "inputs/x_act_eval",
        )

    # The 99.999th percentile on larger inputs (one training call, no eval call).
    for key, k_note in (("x_p512", "max"), ("x_p4096", "second largest")):
        name = f"act/Int8ActPerTensorFloat/identity/percentile_{key[3:]}"
        x = f"inputs/{key}"
        act_case(rec, name, "QuantIdentity", "Int8ActPerTensorFloat", {}, [x], None)
        k = _check_percentile(rec, name, x, 128.0)
        rec.cases[-1]["notes"] = (
            f"scale = |x|_(k) / 128 with k = floor(0.99999 * {rec.arrays[x].size} + 0.5) = {k} "
            f"(1-indexed, the {k_note}): Brevitas' nearest rank"
        )
    _check_percentile(rec, "act/Int8ActPerTensorFloat/identity/default", acts[0], 128.0)

    # Per-channel activation scaling: find out what Brevitas needs.
    x0 = torch.from_numpy(rec.arrays[acts[0]])
    shape = [1, ACT_SHAPE[1], 1, 1]
    attempts = [
        {"scaling_per_output_channel": True},
        {"scaling_per_output_channel": True, "per_channel_broadcastable_shape": shape},
        {"scaling_per_output_channel": True, "scaling_stats_permute_dims": [1, 0, 2, 3]},
        {
            "scaling_per_output_channel": True,
            "per_channel_broadcastable_shape": shape,
            "scaling_stats_permute_dims": [1, 0, 2, 3],
        },
    ]
    for kw in attempts:
        call_kw = {k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()}
        _probe(
            rec,
            f"QuantIdentity({', '.join(f'{k}={v!r}' for k, v in call_kw.items())})(x)",
            lambda call_kw=call_kw: qnn.QuantIdentity(return_quant_tensor=True, **call_kw)(x0),
        )
    per_channel = attempts[-1]
    for suffix, extra in (("default", {}), ("collect_stats_steps=3", {"collect_stats_steps": 3})):
        act_case(
            rec,
            f"act/Int8ActPerTensorFloat/identity/per_channel/{suffix}",
            "QuantIdentity",
            "Int8ActPerTensorFloat",
            {**per_channel, **extra},
            acts,
            "inputs/x_act_eval",
            notes="per-channel percentile over each channel's N*H*W values (nearest rank, "
            "k = floor(0.99999 * 144 + 0.5) = 144: the channel's max |x|)",
        )

    # QuantReLU with a constant scale from max_val, and the HE probe.
    act_case(
        rec,
        "act/QuantReLU/max_val=6/scaling_impl_type=CONST",
        "QuantReLU",
        None,
        {"max_val": 6.0, "scaling_impl_type": "CONST"},
        ["inputs/x_wide"],
        "inputs/x_wide",
        notes="default act_quant Uint8ActPerTensorFloat; constant scale max_val / 255",
    )
    if not _probe(
        rec,
        "QuantReLU(scaling_impl_type='HE')(x)",
        lambda: qnn.QuantReLU(scaling_impl_type="HE", return_quant_tensor=True)(x0),
    ):
        rec.skipped.append(
            {
                "name": "QuantReLU(scaling_impl_type='HE')",
                "reason": rec.probes[-1]["result"],
            }
        )
    # quant_delay_steps=2: calls 0 and 1 pass the input through.
    act_case(
        rec,
        "act/Int8ActPerTensorFloat/identity/quant_delay_steps=2",
        "QuantIdentity",
        "Int8ActPerTensorFloat",
        {"quant_delay_steps": 2},
        acts[:4],
        "inputs/x_act_eval",
        notes="calls 0-1 return the input unquantized (a QuantTensor with that call's scale)",
    )

    # -- layers ----------------------------------------------------------------------
    full = {
        "input_quant": "Int8ActPerTensorFloat",
        "bias_quant": "Int32Bias",
        "output_quant": "Int8ActPerTensorFloat",
    }
    accumulator = {"input_quant": "Int8ActPerTensorFloat", "bias_quant": "Int32Bias"}
    for kind in ("conv", "linear"):
        layer_case(
            rec,
            f"layer/{kind}/input+bias+output",
            kind,
            full,
            3,
            "default weight_quant (Int8WeightPerTensorFloat); output is output_quant's",
        )
        layer_case(
            rec,
            f"layer/{kind}/input+bias/accumulator",
            kind,
            accumulator,
            3,
            "no output_quant: the output QuantTensor is the accumulator's "
            "(scale = input scale * weight scale, Int32Bias at that scale)",
        )

        # Every bias quantizer: at input scale x weight scale, or with its own scale.
        for bias in ("Int8Bias", "Int16Bias", "Int24Bias", "Int8BiasPerTensorFloatInternalScaling"):
            quants = {"input_quant": "Int8ActPerTensorFloat", "bias_quant": bias}
            layer_case(
                rec, f"layer/{kind}/input+bias/{bias}", kind, quants, 1, f"bias_quant={bias}"
            )

    # -- tensor_quant called directly ------------------------------------------------
    for impl in ("BinaryQuant", "ClampedBinaryQuant"):
        tensor_quant_case(rec, impl)


def main(argv: list[str]) -> int:
    """Writes the fixtures.

    Args:
        argv: ``sys.argv``; ``argv[1]``, if given, is the output directory (default:
            qtorchlike's tests/fixtures).

    Returns:
        The exit status (1 if a case raised).
    """
    import brevitas
    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    here = Path(__file__).resolve().parent
    out_dir = Path(argv[1]) if len(argv) > 1 else here.parent / "tests" / "fixtures"
    out_dir.mkdir(parents=True, exist_ok=True)
    rec = Recorder()
    try:
        build(rec)
    except Exception:
        traceback.print_exc()
        return 1
    meta = {
        "generator": "packages/qtorchlike/peer/brevitas_reference.py",
        "brevitas": brevitas.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seed": SEED,
        "array_dtype": "float32 (bit widths, zero points and scales too)",
        "notes": NOTES,
        "skipped": rec.skipped,
        "probes": rec.probes,
        "cases": rec.cases,
    }
    np.savez_compressed(out_dir / "brevitas_reference.npz", **rec.arrays)
    with open(out_dir / "brevitas_reference.json", "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    size = (out_dir / "brevitas_reference.npz").stat().st_size
    print(
        f"wrote {len(rec.cases)} cases, {len(rec.arrays)} arrays ({size / 1e6:.2f} MB) "
        f"to {out_dir}; skipped: {[s['name'] for s in rec.skipped]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
