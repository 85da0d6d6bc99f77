"""Layer-by-layer validation: every quantized tensor of a ``.tflite`` against JAX.

Comparing only a model's outputs cannot tell a wrong op from many right ones: LiteRT's
kernels rescale with fixed-point multipliers whose rounding JAX's float simulation
cannot mirror exactly, so each op may differ from JAX by one step, and these
differences add up with depth (on the tests' 50-layer MobileNetV2-style CNN, 60% of
the outputs were within one step of JAX under LiteRT's builtin kernels). So
:func:`compare_layers` judges each op on its own:

1. the LiteRT interpreter runs the model keeping every tensor
   (:class:`~qlitert.LiteRTModel` with ``preserve_all_tensors=True``);
2. the JAX function runs again, eagerly, and each of its activation quantizations
   (a per-tensor :func:`qlitert.qdq.fake_quant`: one *site*) is matched with the
   ``.tflite`` tensor that holds it: the tensor of the same type, element count,
   scale (to 1e-6 relative) and zero point whose codes are nearest, in any axis
   order (LiteRT keeps convolutions NHWC, so a model written NCHW has its
   activations transposed there);
3. the site's codes in JAX are compared with the tensor's, and the JAX function goes
   on with the tensor's values, so every op in JAX starts from the very inputs its
   LiteRT kernel had.

The rule: every site has a tensor with its parameters, and its codes are within
:data:`TOLERANCE` steps of JAX's everywhere (one step for int8; int16 lookup-table
kernels: :data:`OP_TOLERANCE`); float outputs
(after a float last module) are within :data:`FLOAT_TOLERANCE` relative L2 error.
The first site that fails names the op that computed its tensor. Weights are not
sites (they are constants, checked through the ops that use them).

A function that quantizes under ``jax.jit`` (its sites are traced, so they cannot
be replaced) is compared at its outputs only: 95% of the values within one step
and all within two (:data:`OUTPUT_TOLERANCE`), which holds for shallow models.

Example:
    >>> import flax.linen as nn, jax, numpy as np
    >>> import qlitert
    >>> model = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(4)])
    >>> x = np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32)
    >>> params = model.init(jax.random.key(0), x)
    >>> float_fn = lambda x: model.apply(params, x)
    >>> fn = qlitert.annotate(float_fn, qlitert.calibrate(float_fn, [x]))
    >>> report = qlitert.compare_layers(qlitert.export(fn, x), fn, x)
    >>> print(report.summary())
    under the xnnpack kernels: 3 sites, all within tolerance
    op                       type  max steps  over  site
    0 QUANTIZE               int8          0     0  0:input0@
    1 FULLY_CONNECTED        int8          ...     0  1:dot_general.lhs@Sequential/layers_2
    2 FULLY_CONNECTED        int8          ...     0  2:output0@
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qlitert import qdq
from qlitert.inspection import ModelReport, inspect
from qlitert.runtime import LiteRTModel

# Steps by which a site's codes may differ from JAX's when its op is fed the same
# inputs as its LiteRT kernel: one rescaling rounding. int16 (16x8) convolutions
# and adds were within one int16 step too (a MobileNetV2-style CNN, 57 sites, both
# kernel sets); the int16 TANH, which interpolates a lookup table, within three.
TOLERANCE = {"int8": 1, "int4": 1, "int16": 4}
# Ops whose LiteRT kernel misses the exact value by more: int16 TANH and LOGISTIC
# interpolate a lookup table; a saturating tanh misses by more than 4 steps
# (test_int16.py). Scratch runs, 4,096 inputs over [-8, 8], builtin kernels, LiteRT
# 2.3.0: up to 12 (tanh) and 6 (logistic) int16 steps.
OP_TOLERANCE = {("int16", "TANH"): 16, ("int16", "LOGISTIC"): 16}
# Relative L2 error allowed for a float output (after a float last module).
FLOAT_TOLERANCE = 0.01
# For a function compared at its outputs only: (steps on 95% of the values, on all).
OUTPUT_TOLERANCE = {"INT8": (1.0, 2.0), "INT16": (2.0, 4.0)}
KERNELS = ("xnnpack", "builtin")
_TYPE_NAMES = {"int8": "INT8", "int16": "INT16", "int4": "INT4"}


def tolerance(qtype: str, op_name: str) -> int:
    """Steps a site's codes may differ from JAX's when ``op_name`` computes it.

    Example:
        >>> from qlitert import validation
        >>> validation.tolerance("int8", "ADD"), validation.tolerance("int16", "TANH")
        (1, 16)
    """
    return OP_TOLERANCE.get((qtype, op_name), TOLERANCE[qtype])


@dataclasses.dataclass(frozen=True)
class Layer:
    """One site of the JAX function and the ``.tflite`` tensor that holds it.

    Attributes:
        site: The site's name: a :class:`~qlitert.SiteKey` for an annotated model, the
            ``site=`` of a hand-written :func:`~qlitert.qdq.fake_quant`, else its number.
        qtype: Its type (``"int8"``, ``"int16"``, ``"int4"``).
        scale: JAX's scale.
        zero_point: JAX's zero point.
        tensor: The matched tensor's index (for a site without a tensor of its
            parameters: the tensor nearest in values, or None).
        tensor_name: Its name.
        op: The index of the op that computes it (None: a constant or graph input).
        op_name: That op's name.
        matched: Whether the tensor has the site's parameters.
        max_steps: The largest difference of codes (NaN if not matched).
        over: How many codes differ by more than the tolerance.
        size: How many codes the site has.
    """

    site: str
    qtype: str
    scale: float
    zero_point: int
    tensor: int | None
    tensor_name: str
    op: int | None
    op_name: str
    matched: bool
    max_steps: float
    over: int
    size: int

    @property
    def ok(self) -> bool:
        """Whether the site passes the rule."""
        return self.matched and self.over == 0

    def where(self) -> str:
        """The op and tensor, for messages."""
        op = "a constant or graph input" if self.op is None else f"op {self.op} {self.op_name}"
        return f"{op} (tensor {self.tensor} {self.tensor_name!r})"

    def problem(self, tensors: ModelReport | None = None) -> str:
        """Why the site fails (empty if it passes)."""
        if self.ok:
            return ""
        if not self.matched:
            near = ""
            if tensors is not None and self.tensor is not None:
                t = tensors.tensors[self.tensor]
                near = (
                    f"; nearest in values: {self.where()} with scale {t.scale[0]:.6g}, "
                    f"zero point {t.zero_point[0] if t.zero_point else 0}"
                )
            return (
                f"site {self.site!r}: no {self.qtype} tensor of the .tflite has JAX's "
                f"parameters (scale {self.scale:.6g}, zero point {self.zero_point}){near}"
            )
        return (
            f"site {self.site!r} at {self.where()}: {self.over} of {self.size} codes differ "
            f"from JAX's by more than {tolerance(self.qtype, self.op_name)} step(s) "
            f"(max {self.max_steps:g}) with the op fed the .tflite's own inputs"
        )


@dataclasses.dataclass(frozen=True)
class LayerReport:
    """What :func:`compare_layers` found.

    Attributes:
        kernels: ``"xnnpack"`` or ``"builtin"``.
        layers: Every site in the order JAX computed them.
        outputs: Problems with the outputs.
        replayed: False if no site could be replaced (``fn`` quantizes under
            ``jax.jit``, or has no quantization): then ``layers`` is empty and the
            outputs were compared with :data:`OUTPUT_TOLERANCE`.
        model: The model's ops and tensors (:func:`qlitert.inspect`).
    """

    kernels: str
    layers: tuple[Layer, ...]
    outputs: tuple[str, ...]
    replayed: bool
    model: ModelReport

    def first_failure(self) -> Layer | None:
        """The first site (in JAX's order) that fails, or None."""
        return next((layer for layer in self.layers if not layer.ok), None)

    def problems(self) -> list[str]:
        """The first failing site (and how many more fail), then output problems."""
        failing = [layer for layer in self.layers if not layer.ok]
        problems = []
        if failing:
            more = f" ({len(failing) - 1} more sites fail after it)" if len(failing) > 1 else ""
            problems.append(failing[0].problem(self.model) + more)
        return problems + list(self.outputs)

    def summary(self) -> str:
        """A table: one line per site, with its op and the largest code difference."""
        failing = sum(not layer.ok for layer in self.layers)
        head = f"under the {self.kernels} kernels: {len(self.layers)} sites, " + (
            f"{failing} fail" if failing else "all within tolerance"
        )
        if not self.replayed:
            head += " (fn quantizes under jax.jit: compared at the outputs only)"
        lines = [head, f"{'op':24s} type  max steps  over  site"]
        for layer in self.layers:
            op = "-" if layer.op is None else f"{layer.op} {layer.op_name}"
            steps = "no tensor" if not layer.matched else f"{layer.max_steps:g}"
            lines.append(f"{op:24s} {layer.qtype:5s} {steps:>9s} {layer.over:5d}  {layer.site}")
        return "\n".join(lines + list(self.outputs))


class _Replay:
    """The tap on each site while ``fn`` runs: match, compare, substitute."""

    def __init__(self, model: ModelReport, values: dict[int, np.ndarray]) -> None:
        self.model, self.values = model, values
        self.producer = {o: k for k, op in enumerate(model.ops) for o in op.outputs}
        self.layers: list[Layer] = []
        self.taken: set[int] = set()
        self.traced = False

    def __call__(
        self, y: Any, scale: Any, zero_point: Any, qtype: str, site: str | None
    ) -> jax.Array:
        name = site or f"fake_quant #{len(self.layers)}"
        try:
            values = np.asarray(y, np.float64).reshape(-1)
        except jax.errors.TracerArrayConversionError:  # quantized under jit: no values
            self.traced = True
            return y
        scale, zero_point = float(np.float32(scale)), int(zero_point)
        shape = tuple(np.shape(y))
        # NaN blocks (qlitert's NaN policy) compare as code 0.
        want = np.nan_to_num(np.rint(values / scale) + zero_point).reshape(shape)
        # The nearest codes, in any layout the tensor may have (a model written NCHW
        # is NHWC in LiteRT); on a tie (a mean over one position has its input's
        # values and parameters) a tensor no earlier site took, then the first.
        best: tuple[float, bool, float, int, tuple[int, ...]] | None = None
        for i in self._candidates(qtype, want.size, scale, zero_point):
            got = self.values[i].reshape(-1).astype(np.float64)
            for perm in _layouts(shape, self.values[i].shape):
                diff = np.abs(got - np.transpose(want, perm).reshape(-1))
                key = (float(diff.max(initial=0.0)), i in self.taken, float(diff.sum()), i, perm)
                best = key if best is None or key < best else best
        if best is None:
            near = self._nearest(values)
            self.layers.append(self._layer(name, qtype, scale, zero_point, near, want.size))
            return y
        steps, _, _, i, perm = best
        self.taken.add(i)
        codes = self.values[i].astype(np.float64)
        op = self.producer.get(i)
        allowed = tolerance(qtype, "" if op is None else self.model.ops[op].name)
        diff = np.abs(codes.reshape(-1) - np.transpose(want, perm).reshape(-1))
        over = int(np.sum(diff > allowed))
        self.layers.append(
            self._layer(name, qtype, scale, zero_point, i, want.size, steps=steps, over=over)
        )
        # Back in JAX's layout: the tensor's shape is JAX's shape permuted by perm.
        permuted = tuple(shape[k] for k in perm)
        codes = np.transpose(codes.reshape(permuted), np.argsort(perm)).astype(np.float32)
        return jnp.asarray((codes - np.float32(zero_point)) * np.float32(scale), jnp.result_type(y))

    def _layer(
        self,
        name: str,
        qtype: str,
        scale: float,
        zero_point: int,
        tensor: int | None,
        size: int,
        *,
        steps: float | None = None,
        over: int = 0,
    ) -> Layer:
        op = self.producer.get(tensor) if tensor is not None else None
        return Layer(
            site=name,
            qtype=qtype,
            scale=scale,
            zero_point=zero_point,
            tensor=tensor,
            tensor_name="" if tensor is None else self.model.tensors[tensor].name,
            op=op,
            op_name="" if op is None else self.model.ops[op].name,
            matched=steps is not None,
            max_steps=float("nan") if steps is None else steps,
            over=over,
            size=size,
        )

    def _candidates(self, qtype: str, size: int, scale: float, zero_point: int) -> list[int]:
        """Tensors that can hold the site: its type, size and per-tensor parameters."""
        found = []
        for t in self.model.tensors:
            if t.dtype != _TYPE_NAMES[qtype] or len(t.scale) != 1 or t.index not in self.values:
                continue
            zp = t.zero_point[0] if t.zero_point else 0
            if (
                self.values[t.index].size == size
                and zp == zero_point
                and abs(t.scale[0] - scale) <= 1e-6 * scale
            ):
                found.append(t.index)
        return found

    def _nearest(self, y: np.ndarray) -> int | None:
        """The per-tensor quantized tensor of ``y``'s size whose values are nearest.

        Sorted values are compared, so a tensor in another layout is found too.
        """
        best: tuple[float, int] | None = None
        y = np.sort(y)
        for t in self.model.tensors:
            v = self.values.get(t.index)
            if len(t.scale) != 1 or v is None or v.size != y.size or v.dtype.kind != "i":
                continue
            zp = t.zero_point[0] if t.zero_point else 0
            error = float(np.linalg.norm(np.sort((v.reshape(-1) - zp) * t.scale[0]) - y))
            best = (error, t.index) if best is None or error < best[0] else best
        return None if best is None else best[1]


def _layouts(shape: tuple[int, ...], stored: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Axis orders of ``shape`` that give ``stored`` (the identity first: a reshape).

    LiteRT keeps a convolution's tensors NHWC, so a model written NCHW has its
    activations transposed there.
    """
    identity = tuple(range(len(shape)))
    if len(shape) != len(stored) or len(shape) > 5:
        return [identity]
    # Equal shapes may still differ in layout: NCHW (32, 8, 8, 8) is NHWC (32, 8, 8, 8).
    perms = [p for p in itertools.permutations(identity) if tuple(shape[k] for k in p) == stored]
    return [identity, *(p for p in perms if p != identity)]


def compare_layers(
    tflite: Any, fn: Callable[..., Any], *inputs: Any, kernels: str = "xnnpack"
) -> LayerReport:
    """Compares every quantized tensor of ``tflite`` with ``fn``'s (see the module).

    Args:
        tflite: The model (bytes or a path), converted from ``fn``.
        fn: The quantization-annotated function (an :class:`~qlitert.Annotated`
            model, or one written with :func:`qlitert.qdq.fake_quant`).
        *inputs: One example of each input, as ``fn`` takes them (float values,
            or integer codes for an ``int8_io`` model).
        kernels: ``"xnnpack"`` or ``"builtin"`` (see :class:`~qlitert.LiteRTModel`).

    Returns:
        The report; :meth:`LayerReport.problems` is empty when the model passes.

    Raises:
        ValueError: If LiteRT cannot load or run the model with these kernels, or
            for inputs the model does not take.
    """
    model = LiteRTModel(
        tflite, num_threads=1, quantize_io=False, kernels=kernels, preserve_all_tensors=True
    )
    got = model(*inputs)
    got = got if isinstance(got, tuple) else (got,)
    replay = _Replay(inspect(model.tflite), model.tensors())
    token = qdq._TAP.set(replay)
    try:
        want = jax.tree.leaves(fn(*inputs))
    finally:
        qdq._TAP.reset(token)
    # No site seen: fn quantizes under jit (traced sites, or a cached trace that runs
    # no Python), so nothing could be replaced.
    replayed = bool(replay.layers) and not replay.traced
    if replay.traced:
        want = jax.tree.leaves(jax.jit(fn)(*inputs))
    outputs = _agreement(got, want, _output_steps(replay.model), replayed=replayed)
    layers = tuple(replay.layers) if replayed else ()
    return LayerReport(kernels, layers, tuple(outputs), replayed, replay.model)


def _output_steps(report: ModelReport) -> list[tuple[float | None, str]]:
    """The quantization step and type of each graph output (through a final DEQUANTIZE).

    A float output (a float last module) has no step: ``(None, "FLOAT32")``.
    """
    producer = {o: op for op in report.ops for o in op.outputs}
    steps = []
    for out in report.outputs:
        t = report.tensors[out]
        op = producer.get(out)
        if not t.scale and op is not None and op.name == "DEQUANTIZE":
            t = report.tensors[op.inputs[0]]
        steps.append((max(t.scale), t.dtype) if t.scale else (None, t.dtype))
    return steps


def _agreement(
    got: Sequence[Any],
    want: Sequence[Any],
    steps: list[tuple[float | None, str]],
    *,
    replayed: bool,
) -> list[str]:
    """Problems with the outputs: after a replay, each within its last op's tolerance."""
    problems = []
    for i, (g, w, (step, dtype)) in enumerate(zip(got, want, steps, strict=True)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if step is None:
            error = float(np.linalg.norm(g - w) / max(float(np.linalg.norm(w)), 1e-30))
            if error > FLOAT_TOLERANCE:
                problems.append(
                    f"output {i} (float): relative error {error:.3g} against JAX "
                    f"(need <= {FLOAT_TOLERANCE})"
                )
            continue
        if np.issubdtype(np.asarray(want[i]).dtype, np.integer):
            step = 1.0  # integer outputs are codes: one step is one code
        if replayed:
            qtype = {v: k for k, v in _TYPE_NAMES.items()}.get(dtype, "int8")
            most = worst = float(TOLERANCE[qtype])
            share = 1.0
        else:
            most, worst = OUTPUT_TOLERANCE.get(dtype, OUTPUT_TOLERANCE["INT8"])
            share = 0.95
        diff = np.abs(g - w) / step
        within = float(np.mean(diff <= most + 1e-3))
        if within < share or float(np.max(diff)) > worst + 1e-3:
            problems.append(
                f"output {i} ({dtype}): {within:.1%} of values within {most:g} step(s) of JAX "
                f"(need {share:.0%}), max {float(np.max(diff)):.2f} steps (need <= {worst:g})"
            )
    return problems
