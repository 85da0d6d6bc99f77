"""Quantization report: per-op bytes and error, each op quantized on its own.

:func:`quantization_report` runs a model on calibration batches and returns a
:class:`QuantizationReport` with one :class:`ReportRow` per quantized op. An *op*
here is what a rule can select: a module path and an op name (a module that calls
``dot_general`` twice is one op, with both weights). For each op it gives

* the operand shapes and the rule's weight qtype and tile size;
* ``quantized_bytes`` (codes + scales + zero points of its weights, as stored:
  sub-byte codes packed, i.e. :attr:`qcore.QArray.nbytes`) and ``float_bytes``
  (the float weights' ``nbytes``);
* ``weight_sqnr_db``: ``10·log10(Σw² / Σ(w - ŵ)²)`` over its weights, with ``ŵ``
  the dequantized weight (float64 numpy);
* ``output_sqnr_db``: the same ratio for the model's outputs (every output leaf,
  every batch) when *only this op* is quantized by its rule and every other op
  stays float.

Each op is quantized alone by a :class:`~qflax.QuantizationRule` that selects
exactly it (the escaped module path and the op name, every other field from the
rule the op matched), through the ordinary :class:`~qflax.PtqProvider`, so the
numbers are those of the model users will run. Ops whose rule quantizes only
activations have no weight bytes (0) and an infinite weight SQNR. A weight that
two ops use is listed in both rows.

Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> import qflax
    >>> from qflax.report import quantization_report
    >>> class MLP(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.Dense(8, name="out")(nn.relu(nn.Dense(32, name="hidden")(x)))
    >>> x = jax.random.normal(jax.random.key(1), (4, 16))
    >>> params = MLP().init(jax.random.key(0), x)["params"]
    >>> rules = [qflax.QuantizationRule(weight_qtype="int4", tile_size=8)]
    >>> data = qflax.CalibrationData(MLP(), params, [x])
    >>> report = quantization_report(data, rules, jit=False, progress=False)
    >>> [
    ...     (r.module_path, r.op_name, r.weight_qtype, r.quantized_bytes, r.float_bytes)
    ...     for r in report.rows
    ... ]
    [('hidden', 'dot_general', 'int4', 512, 2048), ('out', 'dot_general', 'int4', 256, 1024)]
    >>> 15 < report.rows[0].weight_sqnr_db < 25
    True
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx, traverse_util

import qcore
from qflax import _files
from qflax._calibration_data import CalibrationData, accepts_legacy, check
from qflax._deprecation import old_name
from qflax._engine import flavor as flavors
from qflax._engine.context import CallContext
from qflax._engine.dispatch import LookupSite, OpSite, Weight
from qflax._model import quantize_model
from qflax._params import plain
from qflax._progress import track
from qflax.providers._ptq import PtqProvider
from qflax.qparam import QuantizedParam, stand_in
from qflax.rule import QuantizationRule

OpKey = tuple[str, str]  # (module path, op name)


# -- running a model with some rules ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QuantizedOp:
    """One quantized op as the discovery run saw it.

    Attributes:
        module_path: The calling module's ``/``-joined path.
        op_name: The op's name (see :data:`qflax.OP_NAMES`).
        shapes: The operand shapes of its first call.
        weights: Param paths of its weight operands, in call order.
        rule: The rule it matched.
    """

    module_path: str
    op_name: str
    shapes: tuple[tuple[int, ...], ...]
    weights: tuple[str, ...]
    rule: QuantizationRule

    @property
    def key(self) -> OpKey:
        """``(module_path, op_name)``."""
        return (self.module_path, self.op_name)

    def exact_rule(self, **changes: Any) -> QuantizationRule:
        """A rule that selects exactly this op (and ``changes`` to its fields)."""
        return dataclasses.replace(
            self.rule,
            module_path=re.escape(self.module_path),
            op_names=(self.op_name,),
            **changes,
        )


class _Recorder(PtqProvider):
    """A PtqProvider that also records which ops it quantized, and their weights."""

    def __init__(self, rules: Sequence[QuantizationRule]) -> None:
        super().__init__(rules)
        self.sites: dict[OpKey, QuantizedOp] = {}

    def visit_op(self, ctx: CallContext, site: OpSite) -> jax.Array:
        """Records the op (if the rule quantizes an operand), then computes it as PTQ."""
        if site.plans != (None, None):
            shapes = tuple(tuple(int(d) for d in x.shape) for x in site.call.operands)
            self._record(site, shapes, *site.plans)
        return super().visit_op(ctx, site)

    def visit_lookup(self, ctx: CallContext, site: LookupSite) -> jax.Array:
        """Records the lookup, then computes it as PTQ."""
        call = site.call
        self._record(site, (tuple(call.table.shape), tuple(call.indices.shape)), site.plan)
        return super().visit_lookup(ctx, site)

    def _record(self, site: OpSite | LookupSite, shapes: tuple, *plans: Any) -> None:
        key = (site.path, site.op)
        weights = tuple(p.source.path for p in plans if isinstance(p, Weight))
        known = self.sites.get(key)
        if known is None:
            self.sites[key] = QuantizedOp(site.path, site.op, shapes, weights, site.rule)
        else:
            merged = known.weights + tuple(w for w in weights if w not in known.weights)
            self.sites[key] = dataclasses.replace(known, weights=merged)


@dataclasses.dataclass(frozen=True)
class Run:
    """The result of running the model with some rules over the calibration batches.

    Attributes:
        noise: ``Σ(y - ŷ)²`` over every output element of every batch (float64).
        quantized: ``{param path: QuantizedParam}`` the rules created.
        sites: The ops the rules quantized (only for runs that record them).
    """

    noise: float
    quantized: dict[str, QuantizedParam]
    sites: dict[OpKey, QuantizedOp]


class Runner:
    """Runs a Linen or NNX model on calibration batches, float or under PTQ rules.

    Float outputs are computed once; every :meth:`run` compiles the model with a
    fresh :class:`~qflax.PtqProvider` (``jax.jit`` / ``nnx.jit``) and quantizes
    its float params inside the model. The model and params are not modified
    (an NNX model is quantized in a copy that shares its arrays).

    Args:
        data: The model, its float params, the batches (a non-empty iterable) and
            the method they are inputs of (:class:`~qflax.CalibrationData`).
        jit: Compile each run (``jax.jit`` / ``nnx.jit``; one compilation per run
            and batch shape). ``False`` runs eagerly: no compilation, slower per
            batch, usually faster for small models and few batches.
    """

    @accepts_legacy(lead=1, between=0)
    def __init__(self, data: CalibrationData, *, jit: bool = True) -> None:
        data = check(data)
        self.batches = list(data.inputs())
        if not self.batches:
            raise ValueError(
                f"no calibration data: {data._arg} is empty (pass at least one batch: "
                "an input array, or a tuple of positional inputs)"
            )
        self.model, self.method, self.kwargs, self.jit = data.model, data.method, data.kwargs, jit
        self.flavor = flavors.of(data.model)
        tree = data.float_tree()
        if self.flavor is flavors.LINEN:
            self.params = tree = nn.meta.unbox(tree)
        else:
            self._graphdef, self._state = nnx.split(self.model)
        self._float_leaves = _flat_params(tree)
        for path, value in self._float_leaves.items():
            if isinstance(value, QuantizedParam):
                raise ValueError(f"params[{path!r}] is already quantized; pass float params")
        if self.flavor is flavors.LINEN:
            float_fn = self._compiled(
                lambda p, args: self.model.apply(
                    {"params": p}, *args, method=self.method, **self.kwargs
                )
            )
            self.reference = [_leaves(float_fn(self.params, a)) for a in self.batches]
        else:
            call = self._compiled(lambda m, args: getattr(m, self.method)(*args, **self.kwargs))
            self.reference = [_leaves(call(self.model, a)) for a in self.batches]
        self.signal = sum(float(np.sum(np.square(y))) for ys in self.reference for y in ys)

    def _compiled(self, fn: Any) -> Any:
        if not self.jit:
            return fn
        return jax.jit(fn) if self.flavor is flavors.LINEN else nnx.jit(fn)

    @property
    def float_params(self) -> dict[str, Any]:
        """``{param path: float array}`` of every parameter."""
        return self._float_leaves

    @property
    def float_bytes(self) -> int:
        """Bytes of every float parameter."""
        return sum(int(np.asarray(v).nbytes) for v in self._float_leaves.values())

    def run(self, rules: Sequence[QuantizationRule], *, record: bool = False) -> Run:
        """Runs the model with ``rules`` quantizing it (PTQ) on every batch."""
        provider = _Recorder(rules) if record else PtqProvider(rules)
        noise = 0.0
        quantized: dict[str, QuantizedParam] = {}
        if self.flavor is flavors.LINEN:
            qmodel = quantize_model(self.model, provider, methods=(self.method,))
            fn = self._compiled(
                lambda p, args: qmodel.apply(
                    {"params": p}, *args, method=self.method, mutable=["params"], **self.kwargs
                )
            )
            for i, (args, ref) in enumerate(zip(self.batches, self.reference, strict=True)):
                y, new = fn(self.params, args)
                noise += _noise(ref, _leaves(y))
                if i == 0:
                    quantized = {
                        k: v
                        for k, v in _flat_params(nn.meta.unbox(new["params"])).items()
                        if isinstance(v, QuantizedParam)
                    }
        else:
            copy = nnx.merge(self._graphdef, self._state, copy=True)
            quantize_model(copy, provider, *self.batches[0], methods=(self.method,), **self.kwargs)
            call = self._compiled(lambda m, args: getattr(m, self.method)(*args, **self.kwargs))
            for args, ref in zip(self.batches, self.reference, strict=True):
                noise += _noise(ref, _leaves(call(copy, args)))
            for path, node in nnx.iter_graph(copy):
                if isinstance(node, nnx.Variable):
                    raw = node.get_raw_value()
                    if isinstance(raw, QuantizedParam):
                        quantized["/".join(str(p) for p in path)] = raw
        sites = provider.sites if isinstance(provider, _Recorder) else {}
        return Run(noise, quantized, dict(sites))

    def sqnr_db(self, noise: float) -> float:
        """Output SQNR in dB of a run's noise energy."""
        return _db(self.signal, noise)

    def total_bytes(self, quantized: dict[str, QuantizedParam]) -> int:
        """Bytes of all params when ``quantized`` replaces some (see the module doc)."""
        total = 0
        for path, value in self._float_leaves.items():
            q = quantized.get(path)
            total += int(q.nbytes) if q is not None else int(np.asarray(value).nbytes)
        return total


def _flat_params(tree: Any) -> dict[str, Any]:
    flat = traverse_util.flatten_dict(
        plain(tree), is_leaf=lambda _, x: isinstance(x, QuantizedParam)
    )
    return {"/".join(str(p) for p in k): v for k, v in flat.items()}


def _leaves(out: Any) -> list[np.ndarray]:
    return [np.asarray(y, np.float64) for y in jax.tree.leaves(out)]


def _noise(ref: list[np.ndarray], got: list[np.ndarray]) -> float:
    return sum(float(np.sum(np.square(r - g))) for r, g in zip(ref, got, strict=True))


def _db(signal: float, noise: float) -> float:
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


# -- the report ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ReportRow:
    """One quantized op of a :class:`QuantizationReport`.

    Attributes:
        module_path: The calling module's ``/``-joined path.
        op_name: The op (``dot_general``, ``einsum``...).
        shapes: Operand shapes ``(lhs, rhs)`` of its first call.
        weights: Param paths of its weights.
        weight_qtype: The rule's weight qtype name, or None.
        tile_size: The rule's tile size (None: per channel).
        act_qtype: The rule's activation qtype name, or None.
        quantized_bytes: Bytes of the quantized weights (codes + scales, as stored).
        float_bytes: Bytes of the float weights.
        weight_sqnr_db: SQNR of the dequantized weights, in dB.
        output_sqnr_db: SQNR of the model outputs with only this op quantized, in dB.
    """

    module_path: str
    op_name: str
    shapes: tuple[tuple[int, ...], ...]
    weights: tuple[str, ...]
    weight_qtype: str | None
    tile_size: Any
    act_qtype: str | None
    quantized_bytes: int
    float_bytes: int
    weight_sqnr_db: float
    output_sqnr_db: float


_COLUMNS = (
    "module path",
    "op",
    "shapes",
    "qtype",
    "tile",
    "bytes",
    "float bytes",
    "w SQNR",
    "out SQNR",
)


@dataclasses.dataclass(frozen=True)
class QuantizationReport:
    """Per-op bytes and errors (see :func:`quantization_report`).

    Attributes:
        rows: One :class:`ReportRow` per quantized op, in call order.
        output_sqnr_db: Output SQNR with every op quantized by the rules.
        quantized_bytes: Bytes of all params with the rules applied.
        float_bytes: Bytes of all float params.
    """

    rows: tuple[ReportRow, ...]
    output_sqnr_db: float
    quantized_bytes: int
    float_bytes: int

    def to_text(self) -> str:
        """The report as an aligned text table, with a totals line."""
        table: list[list[str]] = [list(_COLUMNS)]
        for r in self.rows:
            table.append(
                [
                    r.module_path or "(root)",
                    r.op_name,
                    " ".join("x".join(map(str, s)) for s in r.shapes),
                    _qtype_text(r.weight_qtype, r.act_qtype),
                    "-" if r.tile_size is None else str(r.tile_size),
                    str(r.quantized_bytes),
                    str(r.float_bytes),
                    db_text(r.weight_sqnr_db),
                    db_text(r.output_sqnr_db),
                ]
            )
        lines = text_table(table, left=4)
        ratio = self.quantized_bytes / self.float_bytes if self.float_bytes else math.nan
        lines.append(
            f"all params: {self.quantized_bytes} bytes ({ratio:.3f}x of {self.float_bytes} float); "
            f"output SQNR with every op quantized: {db_text(self.output_sqnr_db)} dB"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()

    def to_json(self) -> str:
        """The report as JSON (non-finite SQNRs become ``null``)."""

        def clean(v: Any) -> Any:
            if isinstance(v, float) and not math.isfinite(v):
                return None
            if isinstance(v, tuple | list):
                return [clean(x) for x in v]
            return v

        rows = [{k: clean(v) for k, v in dataclasses.asdict(r).items()} for r in self.rows]
        return json.dumps(
            {
                "rows": rows,
                "output_sqnr_db": clean(self.output_sqnr_db),
                "quantized_bytes": self.quantized_bytes,
                "float_bytes": self.float_bytes,
            },
            indent=1,
        )

    def plot(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Writes a PNG: SQNR (weight and output) and bytes per op.

        Needs matplotlib (``pip install "jaxquant-qflax[report]"``). The image is
        written next to ``path`` and renamed into place, so a failure leaves what
        was there.

        Args:
            path: The PNG file to write (missing parent directories are created).
            overwrite: Whether a PNG written by this method at ``path`` may be
                replaced (it is recognised by the ``Software`` text entry that
                every plot carries).

        Returns:
            The written path.

        Raises:
            FileExistsError: If ``path`` exists and is not a PNG written by this
                method (any other file or image), or is one and ``overwrite`` is
                False; it is left untouched.
        """
        out = Path(path)
        _files.check_target(out.absolute(), "path", overwrite=overwrite, what="PNG file",
                            problem=_not_a_png)  # fmt: skip
        try:
            from matplotlib.figure import Figure  # noqa: PLC0415 - optional dependency
        except ImportError as err:
            raise ImportError(
                "QuantizationReport.plot needs matplotlib: pip install 'jaxquant-qflax[report]' "
                "(or pip install matplotlib)"
            ) from err
        labels = [
            f"{r.module_path or '(root)'}:{r.op_name} ({_qtype_text(r.weight_qtype, r.act_qtype)})"
            for r in self.rows
        ]
        legend: dict[str, Any] = {"fontsize": "small", "frameon": False}
        y = np.arange(len(self.rows))
        fig = Figure(figsize=(10, 1.2 + 0.35 * max(len(self.rows), 1)), layout="constrained")
        ax_sqnr, ax_bytes = fig.subplots(1, 2, sharey=True)
        h = 0.4
        finite = [
            v for r in self.rows for v in (r.weight_sqnr_db, r.output_sqnr_db) if math.isfinite(v)
        ]
        cap = max(finite, default=0.0) * 1.1 + 1.0
        w_db = [min(r.weight_sqnr_db, cap) for r in self.rows]
        o_db = [min(r.output_sqnr_db, cap) for r in self.rows]
        ax_sqnr.barh(y - h / 2, w_db, h, label="weight")
        ax_sqnr.barh(y + h / 2, o_db, h, label="output (only this op)")
        ax_sqnr.set_xlabel("SQNR (dB, higher is better)")
        ax_sqnr.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=2, **legend)
        ax_bytes.barh(y - h / 2, [r.float_bytes for r in self.rows], h, label="float")
        ax_bytes.barh(y + h / 2, [r.quantized_bytes for r in self.rows], h, label="quantized")
        ax_bytes.set_xlabel("weight bytes")
        ax_bytes.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=2, **legend)
        ax_sqnr.set_yticks(y, labels)
        ax_sqnr.invert_yaxis()
        fig.suptitle(
            f"output SQNR, all ops quantized: {db_text(self.output_sqnr_db)} dB; "
            f"bytes {self.quantized_bytes} / {self.float_bytes} float"
        )
        _files.write_file(
            out.absolute(),
            "path",
            lambda tmp: fig.savefig(tmp, format="png", dpi=100, metadata=_PNG_MARKER),
        )
        return out


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_MARKER = {"Software": "qflax QuantizationReport"}  # a tEXt chunk in every plot


def _not_a_png(path: Path) -> str | None:
    """Why ``path`` is not a PNG that :meth:`QuantizationReport.plot` wrote (None if it is)."""
    if path.is_dir():
        return "it is a directory"
    data = path.read_bytes()
    if not data.startswith(_PNG_SIGNATURE):
        return "it does not start with the PNG signature"
    key, value = next(iter(_PNG_MARKER.items()))
    marker = f"{key}\0{value}".encode("latin-1")
    pos = len(_PNG_SIGNATURE)
    while pos + 8 <= len(data):  # chunks: length, type, data, crc
        size, kind = int.from_bytes(data[pos : pos + 4], "big"), data[pos + 4 : pos + 8]
        if kind == b"tEXt" and data[pos + 8 : pos + 8 + size] == marker:
            return None
        if kind in (b"IDAT", b"IEND"):
            break
        pos += 12 + size
    return f"a PNG without the {key}={value!r} marker that plot writes"


def text_table(rows: Sequence[Sequence[str]], left: int) -> list[str]:
    """Aligned lines of a text table: a header row, a rule, then the rows.

    The first ``left`` columns are left-aligned, the others (numbers) right-aligned.
    """
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _qtype_text(weight: str | None, act: str | None) -> str:
    w = weight or "float"
    return w if act is None else f"w:{w} a:{act}"


def db_text(v: float) -> str:
    """A dB value for a text table: one decimal, or ``inf``."""
    return "inf" if v == math.inf else f"{v:.1f}"


def _qtype_name(q: Any) -> str | None:
    return None if q is None else qcore.qtypes.get(q).name


def weight_noise(
    float_params: dict[str, Any], quantized: dict[str, QuantizedParam], paths: Iterable[str]
) -> tuple[float, float]:
    """``(Σw², Σ(w - ŵ)²)`` in float64 over the weights at ``paths``."""
    signal = noise = 0.0
    for p in paths:
        w = np.asarray(float_params[p], np.float64)
        deq = np.asarray(stand_in(quantized[p]), np.float64)
        signal += float(np.sum(np.square(w)))
        noise += float(np.sum(np.square(w - deq)))
    return signal, noise


@accepts_legacy()
def quantization_report(
    data: CalibrationData,
    rules: Sequence[QuantizationRule],
    *,
    jit: bool = True,
    progress: bool = True,
) -> QuantizationReport:
    """Measures bytes and error of every op the rules quantize, each op on its own.

    Args:
        data: The model (not modified: an NNX model is quantized in copies that
            share its arrays), its float params and the batches (a non-empty
            iterable) (:class:`~qflax.CalibrationData`).
        rules: The PTQ rules, as for :class:`~qflax.PtqProvider`.
        jit: Compile each run (one compilation per op and batch shape); False runs
            eagerly (no compilation: faster for small models and few batches).
        progress: Show progress over ops (tqdm if installed, else stderr).

    Returns:
        A :class:`QuantizationReport`: rows in call order, plus the output SQNR
        and bytes with every op quantized.

    Raises:
        ValueError: No calibration data, already-quantized params, rules that
            quantize no op, or rules the model cannot satisfy (as
            :func:`~qflax.quantize_model` raises them).
    """
    runner = Runner(data, jit=jit)
    rules = tuple(rules)
    full = runner.run(rules, record=True)
    if not full.sites:
        raise ValueError(
            f"rules={list(rules)!r} quantize no op of this model; check module_path "
            "(paths look like 'layers/0/mlp/Dense_0') and weight_qtype / act_qtype"
        )
    rows = []
    for site in track(list(full.sites.values()), "quantization report", progress):
        alone = runner.run([site.exact_rule()])
        weights = tuple(p for p in site.weights if p in alone.quantized)
        w_signal, w_noise = weight_noise(runner.float_params, alone.quantized, weights)
        rows.append(
            ReportRow(
                module_path=site.module_path,
                op_name=site.op_name,
                shapes=site.shapes,
                weights=weights,
                weight_qtype=_qtype_name(site.rule.weight_qtype),
                tile_size=site.rule.tile_size,
                act_qtype=_qtype_name(site.rule.act_qtype),
                quantized_bytes=sum(int(alone.quantized[p].nbytes) for p in weights),
                float_bytes=sum(int(np.asarray(runner.float_params[p]).nbytes) for p in weights),
                weight_sqnr_db=_db(w_signal, w_noise) if weights else math.inf,
                output_sqnr_db=runner.sqnr_db(alone.noise),
            )
        )
    return QuantizationReport(
        rows=tuple(rows),
        output_sqnr_db=runner.sqnr_db(full.noise),
        quantized_bytes=runner.total_bytes(full.quantized),
        float_bytes=runner.float_bytes,
    )


__getattr__ = old_name(__name__, "Site", "QuantizedOp", QuantizedOp)
