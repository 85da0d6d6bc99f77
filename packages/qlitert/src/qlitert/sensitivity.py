r"""Which modules need int16 activations: measured per module, chosen under a budget.

Per-tensor int8 fails where a tensor's range is wide and its values are not: a
transformer's LayerNorms, residual stream and softmax inputs. LiteRT's 16x8 kernels
(int16 activations, int8 weights) fix that at a cost in speed: LiteRT has no
XNNPACK kernels for them. :func:`choose_int16` finds the modules where int16 pays:

1. **Baseline.** The function is calibrated with ``rules`` (default: every op
   int8) and its JAX simulation (:func:`qlitert.annotate`, which the exported
   ``.tflite`` matches op by op) runs on the batches; its *error* is the noise
   energy of the outputs relative to the float outputs',
   ``Σ(y - ŷ)² / Σy²`` (``sqnr_db = -10·log10(error)``).
2. **Sensitivity.** For each candidate module (every module path with an int8 site,
   or those ``candidates`` matches), the same with that module's ops int16: the
   error it removes is its *gain*.
3. **Choice.** Modules are taken in order of gain per op, each only if the int16
   ops stay within ``max_int16_fraction`` of all quantized ops (a proxy for latency: the
   int16 kernels are the slow ones) and if, measured with the modules taken before,
   it lowers the error; the search stops once ``target_sqnr_db`` is reached.

Each measurement calibrates and simulates the function once (eagerly), so the cost
is ``2 + candidates + taken`` runs over the batches; a progress line per run goes to
stderr with ``progress=True``.

Example:
    >>> import flax.linen as nn, jax, numpy as np
    >>> import qlitert
    >>> class Block(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         h = nn.Dense(64, name="up")(nn.LayerNorm(name="norm")(x))
    ...         return x + nn.Dense(16, name="down")(nn.gelu(h))
    >>> x = np.random.default_rng(0).normal(size=(4, 8, 16)).astype(np.float32)
    >>> x[..., 0] *= 30  # one outlier channel: per-tensor int8 loses the rest
    >>> params = Block().init(jax.random.key(0), x)
    >>> fn = lambda v: Block().apply(params, v)
    >>> choice = qlitert.choose_int16(fn, [x], max_int16_fraction=0.5, progress=False)
    >>> choice.sqnr_db > choice.baseline_sqnr_db
    True
    >>> choice.chosen
    ('', 'up')
    >>> tflite = qlitert.export(
    ...     qlitert.annotate(fn, qlitert.calibrate(fn, [x], rules=choice.rules)), x
    ... )
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from qlitert import rules as _rules
from qlitert.annotate import annotate, calibrate
from qlitert.interpreter import UnsupportedOpError
from qlitert.rules import Rule


@dataclasses.dataclass(frozen=True)
class ModuleSensitivity:
    """What int16 activations do for one module.

    Attributes:
        module_path: The module's path (as rules match it; ``""``: the root).
        ops: How many of its ops the baseline makes int8 (:attr:`qlitert.Calibration.module_ops`).
        error: The error with this module int16 and the rest as the baseline.
        gain: The baseline's error minus ``error``.
    """

    module_path: str
    ops: int
    error: float
    gain: float


@dataclasses.dataclass(frozen=True)
class Int16Choice:
    """The result of :func:`choose_int16`.

    Attributes:
        rules: Rules to calibrate with: one int16 rule per chosen module, then the
            baseline rules.
        chosen: The chosen module paths, in the order they were taken.
        baseline_error: The error with the baseline rules.
        error: The error with ``rules``.
        int16_fraction: The share of the quantized ops that are int16 with ``rules``.
        modules: Every candidate's sensitivity, largest gain first.
        refused: Candidates whose int16 rule qlitert refuses (an op without an int16
            kernel, e.g. a concatenate): never chosen.
    """

    rules: tuple[Rule, ...]
    chosen: tuple[str, ...]
    baseline_error: float
    error: float
    int16_fraction: float
    modules: tuple[ModuleSensitivity, ...]
    refused: tuple[str, ...] = ()

    @property
    def sqnr_db(self) -> float:
        """``-10·log10(error)`` (inf for no error)."""
        return _db(self.error)

    @property
    def baseline_sqnr_db(self) -> float:
        """The baseline's SQNR in dB."""
        return _db(self.baseline_error)

    def table(self) -> str:
        """The candidates as text: path, ops, SQNR alone in int16, gain, chosen."""
        lines = [f"{'module':40s} {'ops':>5s} {'SQNR dB':>8s} {'gain':>10s}  chosen"]
        for m in self.modules:
            mark = "yes" if m.module_path in self.chosen else ""
            lines.append(
                f"{m.module_path or '(root)':40s} {m.ops:5d} {_db(m.error):8.2f} "
                f"{m.gain:10.3g}  {mark}"
            )
        lines.append(
            f"baseline {self.baseline_sqnr_db:.2f} dB -> {self.sqnr_db:.2f} dB with "
            f"{len(self.chosen)} module(s) int16 ({100 * self.int16_fraction:.0f}% of the ops)"
        )
        return "\n".join(lines)


def _db(error: float) -> float:
    return math.inf if error <= 0 else -10.0 * math.log10(error)


def _outputs(y: Any) -> list[np.ndarray]:
    leaves = y if isinstance(y, tuple | list) else [y]
    return [np.asarray(v, np.float64) for v in leaves]


class _Measure:
    """Calibrates and simulates ``fn`` with given rules; returns the output error."""

    def __init__(self, fn: Callable[..., Any], batches: list[Any], progress: bool) -> None:
        self.fn, self.batches, self.progress = fn, batches, progress
        self.reference = [_outputs(fn(*_args(b))) for b in batches]
        self.energy = sum(float(np.sum(y**2)) for ys in self.reference for y in ys)
        self.runs = 0

    def __call__(self, rules: Sequence[Rule], what: str) -> tuple[float, Any]:
        """(error, the calibration) with ``rules``."""
        cal = calibrate(self.fn, self.batches, rules=list(rules))
        simulated = annotate(self.fn, cal)
        noise = 0.0
        for batch, reference in zip(self.batches, self.reference, strict=True):
            for y, want in zip(_outputs(simulated(*_args(batch))), reference, strict=True):
                noise += float(np.sum((y - want) ** 2))
        error = noise / max(self.energy, 1e-300)
        self.runs += 1
        if self.progress:
            print(f"choose_int16: run {self.runs} ({what}): {_db(error):.2f} dB", file=sys.stderr)
        return error, cal


def _args(batch: Any) -> tuple[Any, ...]:
    return tuple(batch) if isinstance(batch, tuple | list) else (batch,)


def _ops_by_module(cal: Any, base: tuple[Rule, ...]) -> tuple[dict[str, int], int]:
    """The ops of each module path that ``base`` makes int8, and all quantized ops."""
    checked = _rules.check(list(base))
    int8: dict[str, int] = {}
    total = 0
    for path, ops in cal.module_ops.items():
        act = _rules.lookup(checked, path)[1].act
        total += ops if act is not None else 0
        if act == "int8":
            int8[path] = ops
    return int8, total


def choose_int16(
    fn: Callable[..., Any],
    batches: Iterable[Any],
    *,
    rules: Sequence[Rule] | None = None,
    candidates: str | Callable[[str], bool] | None = None,
    max_int16_fraction: float = 0.5,
    target_sqnr_db: float | None = None,
    progress: bool = True,
) -> Int16Choice:
    """Chooses the modules whose activations are int16 (see the module docstring).

    Args:
        fn: The float function, parameters closed over.
        batches: Calibration inputs (arrays, or tuples of arrays), also those the
            error is measured on.
        rules: The baseline rules (default ``[Rule()]``: every op int8). Int16 rules
            for the chosen modules go before them.
        candidates: A regex fullmatched against module paths, or a callable
            ``path -> bool``, restricting the candidates (default: every module
            with an int8 site).
        max_int16_fraction: The largest share of the quantized ops that may be int16, in
            (0, 1].
        target_sqnr_db: Stop adding modules once the output SQNR reaches this.
        progress: Print one line per measurement to stderr.

    Returns:
        The choice; ``rules`` is what to calibrate with.

    Raises:
        ValueError: For ``max_int16_fraction`` outside (0, 1], a non-finite
            ``target_sqnr_db``, empty ``batches``, or a baseline without int8 ops;
            what :func:`qlitert.calibrate` raises.
    """
    number = isinstance(max_int16_fraction, int | float) and not isinstance(
        max_int16_fraction, bool
    )
    if not number or not 0 < max_int16_fraction <= 1:
        raise ValueError(f"max_int16_fraction={max_int16_fraction!r}; allowed: a number in (0, 1]")
    if target_sqnr_db is not None and not math.isfinite(target_sqnr_db):
        raise ValueError(f"target_sqnr_db={target_sqnr_db!r}; allowed: a finite number or None")
    batches = list(batches)
    if not batches:
        raise ValueError("batches is empty; allowed: one or more calibration batches")
    base = tuple(rules) if rules is not None else (Rule(),)
    match = _matcher(candidates)
    measure = _Measure(fn, batches, progress)
    baseline, cal = measure(base, "baseline")
    int8_ops, total = _ops_by_module(cal, base)
    paths = [p for p in int8_ops if match(p)]
    if not paths:
        raise ValueError(
            "no module has int8 ops under the baseline rules"
            + ("" if candidates is None else f" and matches candidates={candidates!r}")
        )
    modules, refused = [], []
    for path in paths:
        try:
            error, _ = measure([_int16(path), *base], f"{path or '(root)'} int16")
        except UnsupportedOpError:
            refused.append(path)
            continue
        modules.append(ModuleSensitivity(path, int8_ops[path], error, baseline - error))
    modules.sort(key=lambda m: -m.gain)
    chosen: list[str] = []
    error, used = baseline, 0
    for m in sorted(modules, key=lambda m: -m.gain / m.ops):
        if target_sqnr_db is not None and _db(error) >= target_sqnr_db:
            break
        if m.gain <= 0 or (used + m.ops) / max(total, 1) > max_int16_fraction:
            continue
        if chosen:
            trial, _ = measure([*(_int16(p) for p in [*chosen, m.module_path]), *base], "choice")
        else:
            trial = m.error  # measured alone above
        if trial < error:
            chosen.append(m.module_path)
            error, used = trial, used + m.ops
    return Int16Choice(
        rules=(*(_int16(p) for p in chosen), *base),
        chosen=tuple(chosen),
        baseline_error=baseline,
        error=error,
        int16_fraction=used / max(total, 1),
        modules=tuple(modules),
        refused=tuple(refused),
    )


def _int16(path: str) -> Rule:
    """An int16 rule for exactly the module at ``path``."""
    return Rule(module_path=re.escape(path), act_qtype="int16", weight_qtype="int8")


def _matcher(candidates: str | Callable[[str], bool] | None) -> Callable[[str], bool]:
    if candidates is None:
        return lambda _: True
    if callable(candidates):
        return candidates
    Rule(module_path=candidates)  # refuses an unsafe regex, naming it
    pattern = re.compile(candidates)
    return lambda path: pattern.fullmatch(path) is not None
