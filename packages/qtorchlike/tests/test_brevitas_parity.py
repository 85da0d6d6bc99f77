"""qtorchlike against real Brevitas 0.13.4, one test per recorded case.

The fixtures (``fixtures/brevitas_reference.{npz,json}``) are written by
``peer/brevitas_reference.py`` in its own environment (``nox -s brevitas_reference``);
this file reads them with NumPy alone. Every case replays Brevitas' calls on the same
inputs, weights and modes, and compares what qtorchlike returns with what Brevitas
returned: values, scales, zero points, bit widths, signedness, training flags, and the
shapes of all of them (Brevitas' shapes, 0-d included).

Tolerance is 1e-6 relative (float32). A quantized value may differ by exactly one
quantization step only where the test finds that its input sat on a rounding tie
(``|x / scale + zero_point - round(.)| == 0.5`` within 1e-6, with Brevitas' scale and
zero point). Float layer outputs and accumulators, which are sums, are compared
within 1e-6 of the array's largest magnitude. Each failure lists every mismatch of
its case. A name qtorchlike lacks fails its case with a message naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import qtorchlike
import qtorchlike.nn as qnn
from qtorchlike import inject
from qtorchlike import quant as qquant
from qtorchlike.quant_tensor import QuantTensor

FIXTURES = Path(__file__).parent / "fixtures"
META = json.loads((FIXTURES / "brevitas_reference.json").read_text())
with np.load(FIXTURES / "brevitas_reference.npz") as _npz:
    ARRAYS: dict[str, np.ndarray] = {k: _npz[k] for k in _npz.files}
CASES = {case["name"]: case for case in META["cases"]}

RTOL = 1e-6
TIE_TOL = 1e-6
# Brevitas names whose qtorchlike counterpart is called differently on purpose.
RENAMED = {
    "Fp8e4m3OCPWeightPerTensorFloat": "Fp8e4m3WeightPerTensorFloat",
    "Fp8e4m3OCPActPerTensorFloat": "Fp8e4m3ActPerTensorFloat",
    "Fp8e5m2OCPWeightPerTensorFloat": "Fp8e5m2WeightPerTensorFloat",
    "Fp8e5m2OCPActPerTensorFloat": "Fp8e5m2ActPerTensorFloat",
}


# -- comparison helpers ---------------------------------------------------------------


class Report:
    """The mismatches of one case; :meth:`finish` fails once, listing all of them."""

    def __init__(self, case: str) -> None:
        self.case = case
        self.problems: list[str] = []

    def add(self, problem: str) -> None:
        """Records one mismatch."""
        self.problems.append(problem)

    def finish(self) -> None:
        """Fails the test if anything differed from Brevitas."""
        if self.problems:
            lines = "\n  - ".join(self.problems)
            pytest.fail(
                f"{self.case}: {len(self.problems)} difference(s) from Brevitas "
                f"{META['brevitas']}:\n  - {lines}",
                pytrace=False,
            )


def at_tie(x: Any, scale: Any, zero_point: Any) -> np.ndarray:
    """Where ``x`` lies halfway between two codes: ``|x/scale + zp - round(.)| == 0.5``.

    Uses Brevitas' scale and zero point; "== 0.5" holds within ``TIE_TOL``.
    """
    q = np.asarray(x, np.float64) / np.asarray(scale, np.float64)
    q = q + np.asarray(zero_point, np.float64)
    return np.abs(np.abs(q - np.round(q)) - 0.5) <= TIE_TOL


def _np(x: Any) -> np.ndarray:
    return np.asarray(x, np.float64)


def _aligned(
    report: Report, what: str, got: Any, want: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """``got`` and ``want`` as float64 of one shape; a shape mismatch is reported.

    Values are still compared after a shape mismatch when the two hold the same number
    of elements or broadcast together; otherwise None.
    """
    g, w = _np(got), _np(want)
    if g.shape != w.shape:
        report.add(f"{what}: shape {g.shape} != Brevitas {w.shape}")
        if g.size == w.size:
            g = g.reshape(w.shape)
        else:
            try:
                g, w = np.broadcast_arrays(g, w)
            except ValueError:
                return None
    return g, w


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def compare_close(report: Report, what: str, got: Any, want: np.ndarray) -> None:
    """Elementwise within ``RTOL`` relative (scales, zero points, bit widths)."""
    pair = _aligned(report, what, got, want)
    if pair is None:
        return
    g, w = pair
    bad = np.abs(g - w) > RTOL * np.maximum(np.abs(w), np.abs(g)) + 1e-30
    if bad.any():
        i = _first(bad)
        report.add(
            f"{what}: {int(bad.sum())} of {w.size} differ beyond {RTOL:g} relative "
            f"(e.g. at {i}: qtorchlike {g[i]!r}, Brevitas {w[i]!r})"
        )


def compare_sum(report: Report, what: str, got: Any, want: np.ndarray) -> None:
    """Within ``RTOL`` of the largest magnitude (float sums: layer outputs, accumulators)."""
    pair = _aligned(report, what, got, want)
    if pair is None:
        return
    g, w = pair
    tol = RTOL * max(float(np.abs(w).max(initial=0.0)), 1e-30)
    bad = np.abs(g - w) > tol
    if bad.any():
        i = _first(bad)
        report.add(
            f"{what}: {int(bad.sum())} of {w.size} differ by more than {tol:.3g} "
            f"({RTOL:g} of max |Brevitas|; e.g. at {i}: qtorchlike {g[i]!r}, Brevitas {w[i]!r})"
        )


def compare_quantized(
    report: Report,
    what: str,
    got: Any,
    want: np.ndarray,
    x: Any | None,
    scale: np.ndarray,
    zero_point: np.ndarray,
) -> None:
    """Quantized values: within ``RTOL``, or one step apart where ``x`` is at a tie.

    Args:
        report: Collects the mismatches.
        what: Names the compared tensor in messages.
        got: qtorchlike's values.
        want: Brevitas' values.
        x: What the quantizer was fed (None: no tie can be identified, e.g. for
            minifloats, whose steps are not uniform).
        scale: Brevitas' scale (the step), broadcastable to ``want``.
        zero_point: Brevitas' zero point, broadcastable to ``want``.
    """
    pair = _aligned(report, what, got, want)
    if pair is None:
        return
    g, w = pair
    step = np.broadcast_to(np.abs(_np(scale)), w.shape)
    mag = np.maximum(np.maximum(np.abs(w), np.abs(g)), step)
    diff = np.abs(g - w)
    bad = diff > RTOL * mag
    excused = np.zeros_like(bad)
    if x is not None and bad.any():
        one_step = np.abs(diff - step) <= RTOL * mag
        tie = np.broadcast_to(at_tie(x, scale, zero_point), w.shape)
        excused = bad & one_step & tie
        bad = bad & ~excused
    if bad.any():
        i = _first(bad)
        where = ""
        if x is not None:
            q = _np(x) / _np(scale) + _np(zero_point)
            where = f", x/scale+zp = {np.broadcast_to(q, w.shape)[i]!r}"
        report.add(
            f"{what}: {int(bad.sum())} of {w.size} values differ beyond {RTOL:g} relative and "
            f"are not one step apart at a tie ({int(excused.sum())} tie(s) excused; e.g. at "
            f"{i}: qtorchlike {g[i]!r}, Brevitas {w[i]!r}{where})"
        )


def compare_qt(
    report: Report,
    what: str,
    got: Any,
    want: dict[str, Any],
    x: Any | None,
    accumulator: bool = False,
) -> None:
    """A QuantTensor against Brevitas' (fields as stored by the reference script).

    Args:
        report: Collects the mismatches.
        what: Names the tensor in messages.
        got: What qtorchlike returned.
        want: Brevitas' fields (array keys), type name, ``signed`` and ``training``.
        x: The quantizer's input, for identifying ties (None: none identified).
        accumulator: The value is a float sum (a layer's accumulator), compared
            with :func:`compare_sum`.
    """
    if not isinstance(got, QuantTensor):
        report.add(f"{what}: qtorchlike returned {type(got).__name__}, Brevitas a {want['type']}")
        return
    scale, zero_point = ARRAYS[want["scale"]], ARRAYS[want["zero_point"]]
    compare_close(report, f"{what}.scale", got.scale, scale)
    compare_close(report, f"{what}.zero_point", got.zero_point, zero_point)
    compare_close(report, f"{what}.bit_width", got.bit_width, ARRAYS[want["bit_width"]])
    if accumulator:
        compare_sum(report, f"{what}.value", got.value, ARRAYS[want["value"]])
    else:
        if want["type"] == "FloatQuantTensor":
            x = None
        compare_quantized(
            report, f"{what}.value", got.value, ARRAYS[want["value"]], x, scale, zero_point
        )
    if got.signed != want["signed"]:
        report.add(f"{what}.signed: {got.signed} != Brevitas {want['signed']}")
    if got.training != want["training"]:
        report.add(f"{what}.training: {got.training} != Brevitas {want['training']}")


# -- building the qtorchlike side ------------------------------------------------------


def qtl_quant(name: str) -> type:
    """qtorchlike's quantizer for Brevitas' ``name`` (fails the test if it has none)."""
    qname = RENAMED.get(name, name)
    q = getattr(qquant, qname, None)
    if q is None:
        pytest.fail(f"qtorchlike.quant has no {qname} (Brevitas has {name})", pytrace=False)
    return q


def _kwargs(raw: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments from JSON (lists back to tuples)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}


def _run(report: Report, what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, or a failure listing the mismatches so far and the error."""
    try:
        return fn()
    except Exception as e:  # any error is a difference from Brevitas, which ran this
        error = f"{what} raised {type(e).__name__}: {e}"
    report.add(error)
    report.finish()  # fails: the report holds the error
    raise AssertionError(error)


def _load(layer: Any, case: dict[str, Any]) -> None:
    """Brevitas' weight and bias, through the state dict (re-initialising learned scales)."""
    w, b = case["inputs"]["weight"], case["inputs"]["bias"]
    layer.load_state_dict(
        {"weight": jnp.asarray(ARRAYS[w]), "bias": jnp.asarray(ARRAYS[b])}, strict=False
    )


def _call_desc(step: dict[str, Any]) -> str:
    return f"call {step['call']} ({step['mode']}) on {step['input'].removeprefix('inputs/')}"


def run_weight(case: dict[str, Any], report: Report) -> None:
    """A weight quantizer on a layer, eval mode: quant_weight() and the layer's output."""
    q = qtl_quant(case["quantizer"])
    kwargs = _kwargs(case["kwargs"])
    layer_cls = getattr(qnn, case["layer"])
    desc = f"{case['layer']}(*{case['layer_args']}, weight_quant={q.__name__}, **{kwargs})"
    layer = _run(report, desc, lambda: layer_cls(*case["layer_args"], weight_quant=q, **kwargs))
    _run(report, "load_state_dict", lambda: _load(layer, case))
    layer.eval()
    qw = _run(report, "quant_weight()", layer.quant_weight)
    w = ARRAYS[case["inputs"]["weight"]]
    compare_qt(report, "quant_weight()", qw, case["quant_weight"], w)
    x = jnp.asarray(ARRAYS[case["inputs"]["x"]])
    out = _run(report, "layer(x)", lambda: layer(x))
    compare_sum(report, "layer(x)", out, ARRAYS[case["output"]])


def run_act(case: dict[str, Any], report: Report) -> None:
    """An activation layer: Brevitas' training calls in order, then the eval call."""
    kwargs = _kwargs(case["kwargs"])
    if case["quantizer"] is not None:
        kwargs["act_quant"] = qtl_quant(case["quantizer"])
    layer_cls = getattr(qnn, case["layer"])
    shown = {k: getattr(v, "__name__", v) for k, v in kwargs.items()}
    desc = f"{case['layer']}(return_quant_tensor=True, **{shown})"
    layer = _run(report, desc, lambda: layer_cls(return_quant_tensor=True, **kwargs))
    for step in case["steps"]:
        layer.train(step["mode"] == "train")
        x = ARRAYS[step["input"]]
        y = _run(report, _call_desc(step), lambda x=x: layer(jnp.asarray(x)))
        if "output" in step:
            fed = np.maximum(x, 0) if case["layer"] == "QuantReLU" else x
            compare_qt(report, _call_desc(step), y, step["output"], fed)


def run_layer(case: dict[str, Any], report: Report) -> None:
    """A layer with quantized input and bias (and output): training calls, then eval."""
    quants = {arg: qtl_quant(name) for arg, name in case["quant_args"].items()}
    layer_cls = getattr(qnn, case["layer"])
    shown = {k: v.__name__ for k, v in quants.items()}
    desc = f"{case['layer']}(*{case['layer_args']}, return_quant_tensor=True, **{shown})"
    layer = _run(
        report,
        desc,
        lambda: layer_cls(*case["layer_args"], return_quant_tensor=True, **quants),
    )
    _run(report, "load_state_dict", lambda: _load(layer, case))
    for step in case["steps"]:
        layer.train(step["mode"] == "train")
        x = ARRAYS[step["input"]]
        y = _run(report, _call_desc(step), lambda x=x: layer(jnp.asarray(x)))
        fed = step.get("output_quant_input")
        compare_qt(
            report,
            _call_desc(step),
            y,
            step["output"],
            ARRAYS[fed] if fed is not None else None,
            accumulator=fed is None,
        )


def run_tensor_quant(case: dict[str, Any], report: Report) -> None:
    """``Q.tensor_quant(x)`` of an injector naming the implementation, as in Brevitas."""
    impl = getattr(qtorchlike.core, case["tensor_quant"], None)
    if impl is None:
        pytest.fail(f"qtorchlike.core has no {case['tensor_quant']}", pytrace=False)
    scaling = getattr(qtorchlike.core, case["injector"]["scaling_impl"])
    q = type(
        f"My{case['tensor_quant']}Quantizer",
        (inject.ExtendedInjector,),
        {
            "tensor_quant": impl,
            "scaling_impl": scaling,
            "scaling_init": case["injector"]["scaling_init"],
        },
    )
    x = ARRAYS[case["input"]]
    out = _run(report, "Q.tensor_quant(x)", lambda: q.tensor_quant(jnp.asarray(x)))
    want = case["output"]
    if not (isinstance(out, tuple) and len(out) == 4):
        report.add(
            f"Q.tensor_quant(x) returned {type(out).__name__}, Brevitas a tuple "
            "(value, scale, zero_point, bit_width)"
        )
        return
    value, scale, zero_point, bit_width = out
    compare_close(report, "scale", scale, ARRAYS[want["scale"]])
    compare_close(report, "zero_point", zero_point, ARRAYS[want["zero_point"]])
    compare_close(report, "bit_width", bit_width, ARRAYS[want["bit_width"]])
    compare_quantized(
        report,
        "value",
        value,
        ARRAYS[want["value"]],
        x,
        ARRAYS[want["scale"]],
        ARRAYS[want["zero_point"]],
    )


RUNNERS = {
    "weight": run_weight,
    "act": run_act,
    "layer": run_layer,
    "tensor_quant": run_tensor_quant,
}


# -- tests ----------------------------------------------------------------------------


def test_fixtures_are_complete():
    """Every array a case names is stored, in the shape the metadata records."""
    assert META["brevitas"] == "0.13.4"
    assert CASES, "no cases in the fixture"
    for case in META["cases"]:
        for key, shape in case["shapes"].items():
            assert key in ARRAYS, f"{case['name']}: missing array {key}"
            assert list(ARRAYS[key].shape) == shape, f"{case['name']}: {key}"


def test_tie_helper():
    """at_tie finds exact halfway points only."""
    x = np.array([0.5, 1.5, 0.49, 0.25, -2.5, 0.3])
    np.testing.assert_array_equal(at_tie(x, 1.0, 0.0), [True, True, False, False, True, False])
    np.testing.assert_array_equal(at_tie(x, 0.5, 0.25), [False] * 6)
    np.testing.assert_array_equal(at_tie(0.3, 0.2, 0.0), True)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_brevitas(name):
    """qtorchlike gives Brevitas' outputs for the case (see the module docstring)."""
    case = CASES[name]
    report = Report(name)
    RUNNERS[case["kind"]](case, report)
    report.finish()


# qtorchlike's names for what Brevitas spells with keywords: each must give the numbers
# Brevitas gives for that spelling.
SPELLED_WITH_KEYWORDS = {
    "Int4WeightPerChannelFloat": "Int8WeightPerChannelFloat/weight_bit_width=4",
    "Int8WeightPerChannelFloatLSQ": (
        "Int8WeightPerChannelFloat/weight_scaling_impl_type=parameter_from_stats"
    ),
}


@pytest.mark.parametrize("kind", ["conv", "linear"])
@pytest.mark.parametrize("ours", list(SPELLED_WITH_KEYWORDS))
def test_qtorchlike_names_give_brevitas_numbers_for_their_keyword_spelling(ours, kind):
    case = dict(CASES[f"weight/{SPELLED_WITH_KEYWORDS[ours]}/{kind}"])
    case["quantizer"], case["kwargs"] = ours, {}
    report = Report(f"{ours} as {case['name']}")
    run_weight(case, report)
    report.finish()
