r"""Which LiteRT types each module's ops get: qflax rules, read for LiteRT.

qlitert takes the same :class:`qflax.QuantizationRule` objects as qflax and
matches them against the path of the module that computes each op (first match
wins). Quantization is tensor-centric: a rule's ``act_qtype`` is the type of
the *outputs* of the ops in the matched modules, ``weight_qtype`` the type of
their matmul / convolution weights.

========================  ============================================================
``act_qtype``             ``"int8"`` (asymmetric), ``"int16"`` (symmetric, zero point 0:
                          TFLite's 16x8 mode, with int8 weights), None (float output)
``weight_qtype``          ``"int8"`` or ``"int4"`` (symmetric, narrow range, one scale per
                          output channel), None (float weight)
========================  ============================================================

An op no rule matches stays float. Without rules every op is int8. The other
rule fields select what TFLite's kernels fix (per-tensor activations, min/max
ranges, per-channel weights, no rotation), so they must keep their defaults.

Example:
    >>> import qflax
    >>> from qlitert import rules
    >>> r = rules.check(
    ...     [
    ...         qflax.QuantizationRule(module_path="head", act_qtype="int16", weight_qtype="int8"),
    ...         qflax.QuantizationRule(module_path=".*", act_qtype="int8", weight_qtype="int4"),
    ...     ]
    ... )
    >>> rules.lookup(r, "head"), rules.lookup(r, "blocks/0/mlp")
    ((0, OpTypes(act='i16', weight='i8')), (1, OpTypes(act='i8', weight='i4')))
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import qcore
import qflax

ACT_TYPES = {"int8": "i8", "int16": "i16"}
WEIGHT_TYPES = {"int8": "i8", "int4": "i4"}
_DEFAULTS = qflax.QuantizationRule()
_FIXED = (
    "op_names", "tile_size", "weight_calibration_method", "act_calibration_method",
    "act_batch_axes", "rotation",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class OpTypes:
    """LiteRT types (``"i8"``, ``"i16"``, ``"i4"``, or None for float) of an op."""

    act: str | None
    weight: str | None


INT8 = OpTypes("i8", "i8")
FLOAT = OpTypes(None, None)


def _name(qtype: str | qcore.QType | None) -> str | None:
    return None if qtype is None else qcore.qtypes.get(qtype).name


def check(rules: Sequence[qflax.QuantizationRule] | None) -> tuple[qflax.QuantizationRule, ...]:
    """Validates rules for LiteRT; returns them as a tuple (``()`` for None).

    Raises:
        ValueError: Naming the rule, the field, its value and what is allowed.
    """
    if rules is None:
        return ()
    if isinstance(rules, qflax.QuantizationRule):
        rules = [rules]
    out = []
    for i, rule in enumerate(rules):
        if not isinstance(rule, qflax.QuantizationRule):
            raise ValueError(f"rules[{i}]={rule!r} is not a qflax.QuantizationRule")
        act, weight = _name(rule.act_qtype), _name(rule.weight_qtype)
        if act is not None and act not in ACT_TYPES:
            raise ValueError(
                f"rules[{i}].act_qtype={act!r}: LiteRT activations are one of "
                f"{list(ACT_TYPES)} or None (float)"
            )
        if weight is not None and weight not in WEIGHT_TYPES:
            raise ValueError(
                f"rules[{i}].weight_qtype={weight!r}: LiteRT weights are one of "
                f"{list(WEIGHT_TYPES)} or None (float)"
            )
        if act == "int16" and weight == "int4":
            raise ValueError(
                f"rules[{i}]: int16 activations need int8 weights (TFLite's 16x8 kernels); "
                "int4 weights go with int8 activations"
            )
        for field in _FIXED:
            if getattr(rule, field) != getattr(_DEFAULTS, field):
                raise ValueError(
                    f"rules[{i}].{field}={getattr(rule, field)!r}: LiteRT fixes this "
                    f"(per-tensor min/max activations, per-channel absmax weights, every op "
                    f"of the module, no rotation); leave it at {getattr(_DEFAULTS, field)!r}"
                )
        out.append(rule)
    return tuple(out)


def _matches(rule: qflax.QuantizationRule, path: str) -> bool:
    if callable(rule.module_path):
        return bool(rule.module_path(path))
    return re.fullmatch(rule.module_path, path) is not None


def lookup(rules: tuple[qflax.QuantizationRule, ...], path: str) -> tuple[int | None, OpTypes]:
    """The first rule matching ``path`` (its index, or None) and the types it gives.

    Without rules every op is int8; with rules, an op none matches is float.
    """
    if not rules:
        return None, INT8
    i = next((i for i, r in enumerate(rules) if _matches(r, path)), None)
    if i is None:
        return None, FLOAT
    act, weight = _name(rules[i].act_qtype), _name(rules[i].weight_qtype)
    return i, OpTypes(
        None if act is None else ACT_TYPES[act], None if weight is None else WEIGHT_TYPES[weight]
    )
