"""Mixed precision: a weight qtype per op that minimises output error under a byte budget.

:func:`mixed_precision` chooses, for every op with a weight operand, one of the
``candidates`` (e.g. ``"int8"``, ``"int4"``, ``"nf4"`` or ``None`` = float) and
returns weight-only rules (:class:`~qflax.QuantizationRule`, one per quantized op)
that :func:`~qflax.quantize_model` takes as they are.

**Bytes.** The total of an assignment is the size of *every* parameter of the
model: the quantized bytes (codes + scales as stored, sub-byte codes packed) of
each weight an op quantizes, plus the float ``nbytes`` of every other parameter
(float ops' weights, biases, norms, embeddings that are not an op operand). The
budget is ``budget_bytes``, or ``budget_ratio`` times the total float bytes.

**Error.** The output error of a run is the noise energy ``Σ(y - ŷ)²`` over the
model outputs of all calibration batches, relative to the float outputs' energy
``Σy²``; ``output_sqnr_db = -10·log10(error)``.

**Search.** First the model runs once per candidate with every op quantized by
it: that gives every op's bytes (so a budget below the smallest possible total
fails early) and the measured error of each *uniform* plan. Then each op is
measured with each candidate, every other op float (as in
:func:`~qflax.report.quantization_report`), and the errors are
taken as additive (a proxy: quantization noise of different layers is roughly
uncorrelated). Minimising their sum within the budget is a multiple-choice
knapsack, solved exactly by dynamic programming over the budget cut into at most
4096 units (each option's bytes rounded up, so plans always fit); a greedy pass
(from each op's largest candidate, repeatedly take the step that loses the least
error per byte saved until the total fits, then spend what is left on the best
error reduction per byte) is kept if its sum is smaller. The chosen plan is run
with all its ops quantized together, and of it and the uniform plans that fit
the budget, the one with the smallest measured error is returned: the result is
never worse, on the calibration batches, than any single qtype that fits the same
budget.

Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> import qflax
    >>> from qflax.mixed_precision import mixed_precision
    >>> class MLP(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.Dense(8, name="out")(nn.relu(nn.Dense(32, name="hidden")(x)))
    >>> x = jax.random.normal(jax.random.key(1), (4, 16))
    >>> params = MLP().init(jax.random.key(0), x)["params"]
    >>> result = mixed_precision(
    ...     qflax.CalibrationData(MLP(), params, [x]),
    ...     candidates=("int8", "int4"),
    ...     budget_ratio=0.3,
    ...     jit=False,
    ...     progress=False,
    ... )
    >>> result.total_bytes <= result.budget_bytes
    True
    >>> [(r.module_path, r.weight_qtype) for r in result.rules]
    [('hidden', 'int4'), ('out', 'int8')]
    >>> qmodel = qflax.quantize_model(MLP(), qflax.PtqProvider(result.rules))
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np

import qcore
from qflax._calibration_data import CalibrationData, accepts_legacy
from qflax._engine.registry import BUILTIN_DEFAULT_NAMES as DEFAULT_OP_NAMES
from qflax._progress import track
from qflax.report import OpKey, QuantizedOp, Runner, db_text, text_table
from qflax.rule import QuantizationRule, TileSize

FLOAT = "float"


@dataclasses.dataclass(frozen=True)
class Option:
    """One candidate for one op, as measured alone.

    Attributes:
        qtype: The qtype name, or None (float).
        bytes: Bytes of the op's weights with this candidate.
        error: Relative output noise energy with only this op quantized.
    """

    qtype: str | None
    bytes: int
    error: float


@dataclasses.dataclass(frozen=True)
class MixedPrecisionResult:
    """The assignment :func:`mixed_precision` chose.

    Attributes:
        rules: One weight-only rule per quantized op (exact module path and op
            name); ops left float get none. Pass them to :class:`~qflax.PtqProvider`.
        assignment: ``{(module path, op name): qtype name or None}`` for every op.
        total_bytes: Bytes of all params under the assignment (measured).
        float_bytes: Bytes of all float params.
        budget_bytes: The budget.
        error: Measured relative output noise energy, all ops quantized together.
        output_sqnr_db: ``-10·log10(error)``.
        options: ``{op: measured options}``, the per-op table the search used.
    """

    rules: tuple[QuantizationRule, ...]
    assignment: dict[OpKey, str | None]
    total_bytes: int
    float_bytes: int
    budget_bytes: int
    error: float
    output_sqnr_db: float
    options: dict[OpKey, tuple[Option, ...]]

    def to_text(self) -> str:
        """The assignment as an aligned table plus totals."""
        rows = [("module path", "op", "qtype", "bytes", "alone SQNR")]
        for key, qtype in self.assignment.items():
            opt = next(o for o in self.options[key] if o.qtype == qtype)
            db = math.inf if opt.error == 0 else -10 * math.log10(opt.error)
            rows.append((key[0] or "(root)", key[1], qtype or FLOAT, str(opt.bytes), db_text(db)))
        lines = text_table(rows, left=3)
        lines.append(
            f"total {self.total_bytes} bytes ({self.total_bytes / self.float_bytes:.3f}x float, "
            f"budget {self.budget_bytes}); output SQNR {db_text(self.output_sqnr_db)} dB"
        )
        return "\n".join(lines)


def _candidate_names(candidates: Sequence[Any]) -> tuple[str | None, ...]:
    if isinstance(candidates, str) or not candidates:
        raise ValueError(
            f"candidates={candidates!r} must be a non-empty sequence of qtype names or None "
            "(float), e.g. ('int8', 'int4', 'nf4', None)"
        )
    names: list[str | None] = []
    for c in candidates:
        if c is None or c == FLOAT:
            name = None
        else:
            try:
                name = qcore.qtypes.get(c).name
            except ValueError as err:
                raise ValueError(f"candidates: {c!r} is not a qtype: {err}") from None
        if name not in names:
            names.append(name)
    return tuple(names)


def _tile_for(tile_size: TileSize | Mapping[str, TileSize], qtype: str) -> TileSize:
    if isinstance(tile_size, Mapping) and all(isinstance(k, str) for k in tile_size):
        return cast(Mapping[str, TileSize], tile_size).get(qtype)
    return cast(TileSize, tile_size)


@accepts_legacy(between=0)
def mixed_precision(
    data: CalibrationData,
    *,
    candidates: Sequence[str | qcore.QType | None] = ("int8", "int4", "nf4", None),
    budget_bytes: int | None = None,
    budget_ratio: float | None = None,
    tile_size: TileSize | Mapping[str, TileSize] = None,
    module_path: str = ".*",
    op_names: Sequence[str] = DEFAULT_OP_NAMES,
    weight_calibration_method: str = "absmax",
    jit: bool = True,
    progress: bool = True,
) -> MixedPrecisionResult:
    """Assigns a weight qtype per op to minimise output error within a byte budget.

    See the module docstring for how bytes and error are defined and searched.

    Args:
        data: The model (not modified), its float params and the batches (a
            non-empty iterable) (:class:`~qflax.CalibrationData`).
        candidates: qtype names (or QTypes); ``None`` or ``"float"`` keeps an op
            float. Every op may take every candidate.
        budget_bytes: Maximum total bytes of all params.
        budget_ratio: Or: maximum as a fraction of the float params' bytes.
        tile_size: Tile size of the weight rules (as in
            :class:`~qflax.QuantizationRule`), or ``{qtype name: tile size}``
            (missing names: per channel).
        module_path: Regex of the modules whose ops may be quantized (others
            stay float and count at float size).
        op_names: The ops that may be quantized (as in
            :class:`~qflax.QuantizationRule`); add ``"take"`` to include embedding
            tables (each table is then one op, with one scale per row and the
            qtype's ``tile_size`` along the row).
        weight_calibration_method: Weight calibration of every rule.
        jit: Compile each run (one compilation per run and batch shape); False
            runs eagerly (no compilation: faster for small models, few batches).
        progress: Show progress over the measurements (tqdm or stderr).

    Returns:
        A :class:`MixedPrecisionResult`.

    Raises:
        ValueError: No calibration data; an unknown candidate; neither or both
            budgets given, or a budget below the smallest possible total (the
            message gives that minimum); no op with a weight in ``module_path``.
    """
    names = _candidate_names(candidates)
    if (budget_bytes is None) == (budget_ratio is None):
        raise ValueError(
            f"give exactly one of budget_bytes={budget_bytes!r} and budget_ratio="
            f"{budget_ratio!r} (bytes of all params, or a fraction of their float bytes)"
        )
    for name, value in (("budget_ratio", budget_ratio), ("budget_bytes", budget_bytes)):
        if value is not None and not (
            isinstance(value, numbers.Real)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value > 0
        ):
            raise ValueError(f"{name}={value!r} is not allowed; allowed: a finite number > 0")
    runner = Runner(data, jit=jit)
    float_total = runner.float_bytes
    budget = int(budget_bytes) if budget_bytes is not None else int(budget_ratio * float_total)  # type: ignore[operator]

    def rule(site: QuantizedOp | None, qtype: str) -> QuantizationRule:
        fields = {
            "weight_qtype": qtype,
            "tile_size": _tile_for(tile_size, qtype),
            "weight_calibration_method": weight_calibration_method,
        }
        if site is None:
            return QuantizationRule(module_path=module_path, op_names=op_names, **fields)
        return QuantizationRule(
            module_path=site.exact_rule().module_path, op_names=(site.op_name,), **fields
        )

    # One run per candidate with every op quantized by it: the bytes of every op
    # (so a budget that cannot be met fails before the per-op runs) and the
    # measured error of each uniform plan.
    uniform: dict[str | None, tuple[float, int]] = {None: (0.0, float_total)}
    op_bytes: dict[tuple[OpKey, str | None], int] = {}
    sites: dict[OpKey, QuantizedOp] = {}
    quantizing = [n for n in names if n is not None]
    for i, qtype in enumerate(track(quantizing, "mixed precision: uniform", progress)):
        run = runner.run([rule(None, qtype)], record=i == 0)
        if i == 0:
            sites = {k: s for k, s in run.sites.items() if s.weights}
            if not sites:
                raise ValueError(
                    f"module_path={module_path!r} selects no op with a weight operand in this "
                    "model (paths look like 'layers/0/mlp/Dense_0')"
                )
        uniform[qtype] = (run.noise / runner.signal, runner.total_bytes(run.quantized))
        for k, site in sites.items():
            op_bytes[(k, qtype)] = sum(int(run.quantized[p].nbytes) for p in site.weights)
    if not sites:  # only float among the candidates: find the ops with the probe type
        sites = {
            k: s
            for k, s in runner.run([rule(None, "int8")], record=True).sites.items()
            if s.weights
        }
    for k, site in sites.items():
        op_bytes[(k, None)] = sum(
            int(np.asarray(runner.float_params[p]).nbytes) for p in site.weights
        )
    others = float_total - sum(
        int(np.asarray(runner.float_params[p]).nbytes)
        for p in {p for s in sites.values() for p in s.weights}
    )
    smallest = others + sum(min(op_bytes[(k, n)] for n in names) for k in sites)
    if budget < smallest:
        raise ValueError(
            f"budget {budget} bytes (budget_bytes={budget_bytes!r}, budget_ratio="
            f"{budget_ratio!r}, float params {float_total} bytes) is below the smallest "
            f"possible total {smallest} bytes ({smallest / float_total:.3f}x float: every op at "
            f"its smallest candidate of {list(n or FLOAT for n in names)}, plus {others} bytes "
            "of params no op quantizes)"
        )

    options: dict[OpKey, list[Option]] = {k: [] for k in sites}
    jobs = [(k, n) for k in sites for n in names]
    for key, qtype in track(jobs, "mixed precision: per op", progress):
        if qtype is None:
            options[key].append(Option(None, op_bytes[(key, None)], 0.0))
            continue
        if len(sites) == 1:
            error = uniform[qtype][0]
        else:
            error = runner.run([rule(sites[key], qtype)]).noise / runner.signal
        options[key].append(Option(qtype, op_bytes[(key, qtype)], error))

    capacity = budget - others
    plan = min(
        (_knapsack(options, capacity), _greedy(options, capacity)),
        key=lambda plan: sum(o.error for o in plan.values()),
    )
    best: tuple[float, int, dict[OpKey, Option]] | None = None
    qtypes = {o.qtype for o in plan.values()}
    if len(qtypes) > 1:  # a uniform plan was measured already
        run = runner.run([rule(sites[k], o.qtype) for k, o in plan.items() if o.qtype is not None])
        if runner.total_bytes(run.quantized) <= budget:
            best = (run.noise / runner.signal, runner.total_bytes(run.quantized), plan)
    for n, (error, total) in uniform.items():
        if total <= budget and (best is None or error < best[0]):
            best = (
                error,
                total,
                {k: next(o for o in opts if o.qtype == n) for k, opts in options.items()},
            )
    assert best is not None  # the searched plan fits by construction
    error, total, plan = best
    return MixedPrecisionResult(
        rules=tuple(rule(sites[k], o.qtype) for k, o in plan.items() if o.qtype is not None),
        assignment={k: o.qtype for k, o in plan.items()},
        total_bytes=total,
        float_bytes=float_total,
        budget_bytes=budget,
        error=error,
        output_sqnr_db=math.inf if error == 0 else -10.0 * math.log10(error),
        options={k: tuple(v) for k, v in options.items()},
    )


def _knapsack(
    options: dict[OpKey, list[Option]], budget: int, buckets: int = 4096
) -> dict[OpKey, Option]:
    """Exact multiple-choice knapsack on additive errors, bytes rounded up to buckets.

    Dynamic programming over the byte budget cut into at most ``buckets`` units of
    ``g`` bytes; each option's bytes are rounded *up* to whole units, so every plan
    it returns fits the budget exactly, and it is optimal up to that rounding.
    """
    g = max(1, -(-budget // buckets))
    cap = budget // g
    keys = list(options)
    best = np.zeros(cap + 1)  # best[b]: least error of the ops so far within b units
    choices = []
    for k in keys:
        new = np.full(cap + 1, np.inf)
        pick = np.zeros(cap + 1, np.int64)
        for i, o in enumerate(options[k]):
            w = -(-o.bytes // g)
            if w > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[w:] = best[: cap + 1 - w] + o.error
            better = cand < new
            new[better], pick[better] = cand[better], i
        best = new
        choices.append(pick)
    plan = {}
    b = int(np.argmin(best))
    if not np.isfinite(best[b]):
        return _greedy(options, budget)  # rounding left no plan: fall back
    for k, pick in zip(reversed(keys), reversed(choices), strict=True):
        o = options[k][int(pick[b])]
        plan[k] = o
        b -= -(-o.bytes // g)
    return {k: plan[k] for k in keys}


def _greedy(options: dict[OpKey, list[Option]], budget: int) -> dict[OpKey, Option]:
    """Greedy multiple-choice knapsack on additive errors (see the module docstring)."""
    plan = {k: max(opts, key=lambda o: (o.bytes, -o.error)) for k, opts in options.items()}
    used = sum(o.bytes for o in plan.values())
    while used > budget:
        best = None
        for k, opts in options.items():
            cur = plan[k]
            for o in opts:
                saved = cur.bytes - o.bytes
                if saved > 0:
                    score = ((o.error - cur.error) / saved, -saved)
                    if best is None or score < best[0]:
                        best = (score, k, o)
        assert best is not None  # the budget is at least the smallest total
        _, k, o = best
        used -= plan[k].bytes - o.bytes
        plan[k] = o
    while True:
        best = None
        for k, opts in options.items():
            cur = plan[k]
            for o in opts:
                gain = cur.error - o.error
                extra = o.bytes - cur.bytes
                if gain > 0 and used + extra <= budget:
                    score = gain / max(extra, 1)
                    if best is None or score > best[0]:
                        best = (score, k, o)
        if best is None:
            return plan
        _, k, o = best
        used += o.bytes - plan[k].bytes
        plan[k] = o
