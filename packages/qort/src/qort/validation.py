"""Op-by-op validation of an exported graph against JAX, under ONNX Runtime.

Every equation the converter lowered (and every captured quantized op) is a *unit*.
Validation cuts the graph at the units' boundaries: each unit becomes a separate
piece of one ONNX model whose inputs are fed the JAX values recorded on the example
inputs, so each op is judged on its own, whatever the depth of the model, and the
first op that disagrees is named. The rule, per unit:

- **Integer and boolean results**: equal.
- **Floating-point results**: ``max |onnx - jax| <= 1e-4 * max |jax|`` (ONNX
  Runtime's and XLA's ``exp``, ``erf``, sums and products round differently);
  float16 results: one float16 step, ``2**-10 * max |jax|``.
- **Dynamic-range (w8a8) products** (:mod:`qort._quantized`): the activation codes
  equal qcore's, except one step at qcore's tie rule (a value within 32 ulps above
  ``-127.5`` goes to ``-128``) for a row minimum that occurs twice: the graph applies
  the rule to the first one (counted as ``ties``). The output
  equals the exact integer product of ONNX Runtime's own codes times both scales
  (float64, relative ``1e-5``; products with more than 1,024 rows are recomputed on
  1,024 rows spread over them) and differs from JAX's by at most what the tie
  steps explain (plus ``1e-5`` relative).

- **Marked fake quantizations** (:mod:`qort.qdq`, ``QuantizeLinear`` →
  ``DequantizeLinear``): the codes equal the ones JAX's value implies
  (``round(value / scale) + zero_point``), except one step where the quotient
  ``x / scale`` is a rounding tie up to float32 rounding (within ``2**-18`` of
  its magnitude of a half-integer): ``QuantizeLinear`` divides and rounds half to
  even, while a model's JAX arithmetic may multiply by ``fl(1 / scale)`` or apply
  qcore's tie rule. Those steps are counted (``steps``); any other difference
  fails. The dequantized values equal JAX's up to those steps.

The whole model is also run once on the example inputs (``end_to_end``: the largest
difference of each output from JAX, reported, not judged: one-step differences
propagate), and ONNX Runtime's optimized graph is checked to compute each w8a8
product with an integer kernel and to keep every rounding to float16 (cut into
units, the graph cannot show a rounding the optimizer removes across two of them).
Weight-only products it leaves as ``DequantizeLinear`` + float ``MatMul`` (not
fused into ``MatMulNBits``) are listed, not failed, and so is each ``Conv`` /
``MatMul`` between dequantized activations and dequantized weights that it left as
a float op (``unfused_products``).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import onnx
from onnx import helper

import qcore
from qort._capture import SiteRecord
from qort._converter import Converted
from qort._graph import Tensor, Unit, value_info
from qort._quantized import CodeCheck, QdqCheck
from qort.session import session_options

FLOAT_RTOL = 1e-4
EXACT_RTOL = 1e-5
# A quotient this close (relative) to a half-integer is a rounding tie up to float32
# rounding of x / scale (a true division and x * fl(1/scale) differ by ~2**-23).
TIE_RTOL = 2.0**-18
# Rows of a w8a8 product recomputed exactly (all of them up to this many).
_EXACT_ROWS = 1024
# Units fed per ONNX Runtime session, by bytes of their inputs.
_CHUNK_BYTES = 1 << 30
# ONNX Runtime's names of the ops that compute a product with integers.
INTEGER_KERNELS = (
    "MatMulInteger",
    "MatMulIntegerToFloat",
    "DynamicQuantizeMatMul",
    "QGemm",
    "QLinearMatMul",
    "MatMulNBits",
    "ConvInteger",
    "QLinearConv",
    "QLinearAdd",
    "QLinearMul",
)


@dataclasses.dataclass(frozen=True)
class UnitResult:
    """One unit's verdict.

    Attributes:
        label: The op (``"tanh"``, ``"dot_general layer_0/query/dot_general0"``).
        source: Where it was traced (module path or name stack).
        error: Largest difference from JAX, in the unit's measure (see the module).
        tolerance: What the rule allows there.
        ties: Activation codes one step from qcore's at its tie rule (w8a8), or codes
            one step from JAX's at a rounding tie (marked fake quantizations).
        ok: Whether the unit passes.
        detail: Why it fails, if it does.
    """

    label: str
    source: str
    error: float
    tolerance: float
    ties: int = 0
    ok: bool = True
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class ValidationReport:
    """The result of :func:`validate`.

    Attributes:
        units: One result per unit, in graph order.
        end_to_end: Per output: ``max |onnx - jax|`` on the example inputs.
        integer_sites: Dynamic-range (w8a8) products in the graph.
        integer_kernels: Integer product kernels in ONNX Runtime's optimized graph.
        provider: The execution provider the graph ran under.
        unfused_weight_only: Weight-only products (their sites) that ONNX Runtime's
            optimized graph still computes as ``DequantizeLinear`` + float ``MatMul``
            (it fuses blocks that are a power of two >= 16 into ``MatMulNBits``); not
            a failure: the result is right, only slower and the weight dequantized in
            memory.
        float16_roundings_lost: Casts to float16 of the graph that ONNX Runtime's
            optimized graph no longer has (it computes float16 ops without a float16
            kernel in float32 and drops a rounding that feeds one); must be 0.
        qdq_units: Marked fake quantizations (``QuantizeLinear`` → ``DequantizeLinear``).
        qdq_steps: Their codes one step from JAX's at a rounding tie (see the module).
        qdq_products: ``Conv`` / ``MatMul`` nodes between dequantized activations and
            dequantized weights.
        unfused_products: Those that ONNX Runtime's optimized graph still computes
            as float ops (not an error: reported), with where they were traced.
    """

    units: tuple[UnitResult, ...]
    end_to_end: tuple[float, ...]
    integer_sites: int
    integer_kernels: int
    provider: str = "CPUExecutionProvider"
    float16_roundings_lost: int = 0
    unfused_weight_only: tuple[str, ...] = ()
    qdq_units: int = 0
    qdq_steps: int = 0
    qdq_products: int = 0
    unfused_products: tuple[str, ...] = ()

    @property
    def failures(self) -> list[UnitResult]:
        """The units that fail."""
        return [u for u in self.units if not u.ok]

    @property
    def ok(self) -> bool:
        """Every unit passes and every w8a8 product runs on an integer kernel."""
        return (
            not self.failures
            and self.integer_kernels >= self.integer_sites
            and not self.float16_roundings_lost
        )

    def __str__(self) -> str:
        ties = sum(u.ties for u in self.units if u.label != "quantize_dequantize")
        lines = [
            f"{len(self.units)} ops checked one by one under {self.provider}: "
            f"{len(self.failures)} disagree; {self.integer_sites} w8a8 products, "
            f"{self.integer_kernels} integer kernels after optimization; "
            f"{ties} activation codes one step away at qcore's tie rule",
            "end to end, max |onnx - jax| per output: "
            + ", ".join(f"{e:.3g}" for e in self.end_to_end),
        ]
        if self.unfused_weight_only:
            lines.append(
                f"  {len(self.unfused_weight_only)} weight-only products run as "
                "DequantizeLinear + float MatMul (not fused into MatMulNBits): "
                + ", ".join(self.unfused_weight_only[:5])
                + (", ..." if len(self.unfused_weight_only) > 5 else "")
            )
        if self.float16_roundings_lost:
            lines.append(
                f"  FAIL {self.float16_roundings_lost} roundings to float16 of the graph were "
                "removed by ONNX Runtime's optimizer"
            )
        if self.qdq_units or self.qdq_products:
            lines.insert(
                1,
                f"{self.qdq_units} QuantizeLinear/DequantizeLinear pairs, {self.qdq_steps} "
                "codes one step from JAX's at a rounding tie; "
                f"{self.qdq_products} products of dequantized operands, "
                f"{self.qdq_products - len(self.unfused_products)} fused into integer kernels",
            )
            for p in self.unfused_products:
                lines.append(f"  not fused by ONNX Runtime: {p}")
        for u in self.failures[:10]:
            lines.append(f"  FAIL {u.label} ({u.source}): {u.detail}")
        return "\n".join(lines)


def validate(
    conv: Converted, *, threads: int | None = None, example_outputs: Sequence[Any] | None = None
) -> ValidationReport:
    """Validates a converted model op by op (see the module docstring)."""
    units = [(i, u) for i, u in enumerate(conv.graph.units) if u.nodes]
    results: dict[int, UnitResult] = {}
    for chunk in _chunks(units, conv.refs) if units else []:  # outputs may be inputs
        outputs = _run_cut(conv, chunk, threads)
        for i, unit in chunk:
            results[i] = _judge(conv, i, unit, outputs)
    end_to_end, kernels, lost, dequantized, unfused = _run_whole(conv, threads, example_outputs)
    sites = sum(1 for i, _ in units if i in conv.checks)  # pruned sites do not count
    unfused_weight_only = tuple(
        u.quantized.where
        for _, u in units
        if isinstance(u.quantized, SiteRecord)
        and u.quantized.op == "dot_general"
        and u.quantized.act_spec is None
        and any(_dequantized_weight(conv, k) in dequantized for k in u.nodes)
    )
    qdq_units = [i for i, _ in units if i in conv.qdq_checks]
    return ValidationReport(
        tuple(results[i] for i, _ in units),
        end_to_end,
        sites,
        kernels,
        float16_roundings_lost=lost,
        unfused_weight_only=unfused_weight_only,
        qdq_units=len(qdq_units),
        qdq_steps=sum(results[i].ties for i in qdq_units),
        qdq_products=len(conv.products),
        unfused_products=unfused,
    )


def _dequantized_weight(conv: Converted, k: int) -> str | None:
    """The weight initializer a DequantizeLinear node reads (None for other nodes)."""
    node = conv.graph.nodes[k]
    return node.input[0] if node.op_type == "DequantizeLinear" else None


def _chunks(units: list[tuple[int, Unit]], refs: dict[str, np.ndarray]) -> list[list]:
    chunks: list[list] = [[]]
    size = 0
    for i, unit in units:
        nbytes = sum(refs[t.name].nbytes for t in unit.inputs)
        if chunks[-1] and size + nbytes > _CHUNK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append((i, unit))
        size += nbytes
    return chunks


def _fed(i: int, name: str) -> str:
    return f"u{i}:{name}"


def _run_cut(conv: Converted, chunk: list[tuple[int, Unit]], threads: int | None) -> dict:
    """Runs each unit of ``chunk`` on its own JAX inputs, in one session."""
    import onnxruntime as ort  # noqa: PLC0415 - heavy; only validation and sessions need it

    nodes, inputs, outputs, feeds, needed = [], [], [], {}, set()
    for i, unit in chunk:
        rename = {t.name: _fed(i, t.name) for t in unit.inputs}
        for t in unit.inputs:
            inputs.append(value_info(dataclasses.replace(t, name=rename[t.name])))
            feeds[rename[t.name]] = conv.refs[t.name]
        for k in unit.nodes:
            node = onnx.NodeProto()
            node.CopyFrom(conv.graph.nodes[k])
            node.input[:] = [rename.get(x, x) for x in node.input]
            needed.update(node.input)
            nodes.append(node)
        produced = {o for k in unit.nodes for o in conv.graph.nodes[k].output}
        outs = [t for t in unit.outputs if t.name in produced]
        check = conv.checks.get(i)
        if check is not None:
            rows = check.shape[0]
            outs += [
                Tensor(check.codes, check.shape, np.dtype(np.uint8)),
                Tensor(check.act_scale, (rows, 1), np.dtype(np.float32)),
            ]
        qcheck = conv.qdq_checks.get(i)
        if qcheck is not None:
            (x,) = unit.inputs
            outs.append(Tensor(qcheck.codes, x.shape, qcheck.dtype))
        outputs += [value_info(t) for t in outs]
    inits = [t for k, t in conv.graph.initializers.items() if k in needed]
    graph = helper.make_graph(nodes, "cut", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=conv.model.opset_import)
    model.ir_version = conv.model.ir_version
    session = ort.InferenceSession(
        model.SerializeToString(), session_options(threads), providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in outputs]
    return dict(zip(names, session.run(names, feeds), strict=True))


def _judge(conv: Converted, i: int, unit: Unit, outputs: dict) -> UnitResult:
    check = conv.checks.get(i)
    if check is not None:
        return _judge_dynamic(conv, unit, check, outputs)
    qcheck = conv.qdq_checks.get(i)
    if qcheck is not None:
        return _judge_qdq(conv, unit, qcheck, outputs)
    worst = UnitResult(unit.label, unit.source, 0.0, 0.0)
    for t in unit.outputs:
        if t.name not in outputs:
            continue
        got, want = np.asarray(outputs[t.name]), conv.refs[t.name]
        if got.shape != want.shape:
            return dataclasses.replace(
                worst, ok=False, error=np.inf, detail=f"shape {got.shape}, JAX {want.shape}"
            )
        if np.issubdtype(want.dtype, np.floating):
            err, tol, ok = _float_error(got, want)
        else:
            err = float(np.sum(got != want))
            tol, ok = 0.0, err == 0
        if not ok or err > worst.error:
            detail = "" if ok else f"max difference {err:.3g} > allowed {tol:.3g}"
            worst = dataclasses.replace(worst, error=err, tolerance=tol, ok=ok, detail=detail)
            if not ok:
                return worst
    return worst


def _float_error(got: np.ndarray, want: np.ndarray) -> tuple[float, float, bool]:
    """``(max |got - want|, allowed, ok)`` over finite values; NaNs and infs must match.

    Computed in float32 (the values' own precision: the difference of two float32
    numbers is off by at most half an ulp of itself, far below the tolerance).
    """
    finite = np.isfinite(want) & np.isfinite(got)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf where not finite
        err = float(np.max(np.abs(got - want), where=finite, initial=0.0))
    # float16 results: one float16 step at the largest magnitude (float32 ops rounded
    # to float16 by ONNX Runtime and XLA land a step apart where float32 ones differ).
    rtol = (
        max(FLOAT_RTOL, float(np.finfo(want.dtype).eps)) if want.dtype.itemsize < 4 else FLOAT_RTOL
    )
    tol = rtol * float(np.max(np.abs(want), where=finite, initial=0.0))
    special = ~np.isfinite(want)
    same = np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(
        got[special & ~np.isnan(want)], want[special & ~np.isnan(want)]
    )
    return err, tol, err <= tol and same and bool(np.all(np.isfinite(got) | special))


def _judge_dynamic(conv: Converted, unit: Unit, check: CodeCheck, outputs: dict) -> UnitResult:
    (x,) = unit.inputs
    rows, cols = check.shape
    jax_q = qcore.quantize(jnp.asarray(conv.refs[x.name]), check.spec)
    jax_codes = np.transpose(np.asarray(jax_q.qvalue, np.int32), check.perm).reshape(rows, cols)
    codes = outputs[check.codes].astype(np.int32).reshape(rows, cols) - 128
    diff = codes - jax_codes
    ties = (diff == 1) & (jax_codes == -128)
    base = UnitResult(unit.label, unit.source, 0.0, 0.0, int(np.sum(ties)))
    bad = int(np.sum((diff != 0) & ~ties))
    if bad:
        return dataclasses.replace(
            base, ok=False, error=float(bad), detail=f"{bad} activation codes differ from qcore's"
        )
    (out,) = unit.outputs
    k, n = check.weight.shape
    m = rows * cols // k
    weight_first = unit.quantized.weight_side == 0
    y = _as_mn(outputs[out.name], m, n, weight_first)
    y_jax = _as_mn(conv.refs[out.name], m, n, weight_first)
    scale = np.repeat(outputs[check.act_scale].astype(np.float64), m // rows, axis=0)
    w64 = check.weight.astype(np.float64)
    w_scale = check.weight_scale.astype(np.float64)
    # Integer sums in float64 are exact while below 2**53 (|code| <= 128: any K < 5e11).
    # Large products are recomputed on _EXACT_ROWS rows spread over the output.
    sel = np.arange(m) if m <= _EXACT_ROWS else np.linspace(0, m - 1, _EXACT_ROWS).astype(int)
    codes_mk = codes.reshape(m, k)
    exact = (codes_mk[sel].astype(np.float64) @ w64) * scale[sel] * w_scale
    span = float(np.max(np.abs(exact), initial=0.0))
    err_exact = float(np.max(np.abs(y[sel] - exact), initial=0.0))
    # Rows where a code differs from qcore's may differ from JAX by what those steps
    # explain; the others by rounding only.
    allowed = np.full((m, 1), EXACT_RTOL * span)
    stepped = np.flatnonzero(np.any(diff.reshape(m, k) != 0, axis=1))
    if stepped.size:
        steps = np.abs(diff.reshape(m, k)[stepped]).astype(np.float64) @ np.abs(w64)
        allowed = np.broadcast_to(allowed, (m, n)).copy()
        allowed[stepped] += steps * scale[stepped] * w_scale
    err_jax = float(np.max(np.abs(y - y_jax) - allowed, initial=0.0))
    tol = EXACT_RTOL * span
    if err_exact > tol:
        detail = f"output differs from the exact integer product by {err_exact:.3g} > {tol:.3g}"
        return dataclasses.replace(base, ok=False, error=err_exact, tolerance=tol, detail=detail)
    if err_jax > 0:
        detail = f"output differs from JAX's by {err_jax:.3g} more than the tie steps explain"
        return dataclasses.replace(base, ok=False, error=err_jax, tolerance=tol, detail=detail)
    return dataclasses.replace(base, error=err_exact, tolerance=tol)


def _judge_qdq(conv: Converted, unit: Unit, check: QdqCheck, outputs: dict) -> UnitResult:
    """A marked fake quantization: codes against JAX's, one step allowed at ties."""
    (x,), (out,) = unit.inputs, unit.outputs
    x64 = conv.refs[x.name].astype(np.float64)
    want = conv.refs[out.name].astype(np.float64)
    s, z = check.scale, check.zero_point
    finite = np.isfinite(x64) & np.isfinite(want)
    jax_codes = np.where(finite, np.round(np.where(finite, want, 0) / s) + z, 0)
    codes = np.where(finite, outputs[check.codes].astype(np.float64) - check.offset, 0)
    diff = codes - jax_codes
    q = np.where(finite, x64, 0) / s + z
    tie = np.abs(np.abs(q - np.floor(q)) - 0.5) <= TIE_RTOL * np.maximum(np.abs(q), 1.0)
    steps = (np.abs(diff) == 1) & tie
    base = UnitResult(unit.label, unit.source, 0.0, 0.0, int(np.sum(steps)))
    bad = int(np.sum((diff != 0) & ~steps))
    if bad:
        at = tuple(np.argwhere((diff != 0) & ~steps)[0])
        detail = (
            f"{bad} codes differ from JAX's away from rounding ties (e.g. at {at}: x / scale "
            f"= {q[at]:.6f}, ONNX {codes[at]:g}, JAX {jax_codes[at]:g})"
        )
        return dataclasses.replace(base, ok=False, error=float(bad), detail=detail)
    y = np.asarray(outputs[out.name], np.float64)
    allowed = EXACT_RTOL * float(np.max(np.abs(want), where=finite, initial=0.0))
    err = float(np.max(np.abs(y - want) - np.abs(diff) * s, where=finite, initial=0.0))
    if err > allowed:
        detail = f"dequantized values differ from JAX's by {err:.3g} beyond the code steps"
        return dataclasses.replace(base, ok=False, error=err, tolerance=allowed, detail=detail)
    return dataclasses.replace(base, error=err, tolerance=allowed)


def _as_mn(y: np.ndarray, m: int, n: int, weight_first: bool) -> np.ndarray:
    y = np.asarray(y, np.float64)
    return y.reshape(n, m).T if weight_first else y.reshape(m, n)


def _run_whole(
    conv: Converted, threads: int | None, example_outputs: Sequence[Any] | None
) -> tuple[tuple[float, ...], int, int, set[str], tuple[str, ...]]:
    """Runs the whole graph once.

    Returns per-output errors, integer kernels, lost float16 roundings, the
    initializers a DequantizeLinear still reads after optimization, and the products
    of dequantized operands ONNX Runtime left as float ops.
    """
    import onnxruntime as ort  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        options = session_options(threads)
        options.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        session = ort.InferenceSession(
            conv.model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        optimized = onnx.load(options.optimized_model_filepath, load_external_data=False)
    kernels = sum(node.op_type in INTEGER_KERNELS for node in optimized.graph.node)
    lost = len(_float16_casts(conv.model) - _float16_casts(optimized))
    dequantized = {n.input[0] for n in optimized.graph.node if n.op_type == "DequantizeLinear"}
    # A product counts as fused when an integer kernel carries its name (ONNX Runtime
    # keeps it, sometimes with a "_token_<n>" suffix); anything else is reported.
    fused = {
        p
        for node in optimized.graph.node
        if node.op_type in INTEGER_KERNELS
        for p in conv.products
        if node.name == p or node.name.startswith(p + "_")
    }
    unfused = tuple(where for p, where in conv.products.items() if p not in fused)
    feeds = {t.name: conv.refs[t.name] for t in conv.inputs}
    got = session.run([t.name for t in conv.outputs], feeds)
    wants = example_outputs or [conv.refs.get(t.name) for t in conv.outputs]
    errors = []
    for g_, w in zip(got, wants, strict=True):
        g64, w64 = np.asarray(g_, np.float64), np.asarray(w, np.float64)
        with np.errstate(invalid="ignore"):  # inf - inf where both are inf
            diff = np.where(g64 == w64, 0.0, np.abs(g64 - w64))
        errors.append(float(np.max(diff, initial=0.0)))
    return tuple(errors), kernels, lost, dequantized, unfused


def _float16_casts(model: onnx.ModelProto) -> set[str]:
    """The values that Cast nodes round to float16.

    ONNX Runtime may merge two Casts of one value; a value of the exported graph
    that no Cast reads any more after optimization lost its rounding.
    """
    return {
        node.input[0]
        for node in model.graph.node
        if node.op_type == "Cast"
        and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT16 for a in node.attribute)
    }
