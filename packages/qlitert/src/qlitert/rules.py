r"""Which LiteRT types each module's ops get: :class:`Rule`, matched by module path.

A :class:`Rule` selects modules by the path of the module that computes each op
(first match wins: :mod:`qcore.rules` matches them, as it matches qflax's rules).
Quantization is tensor-centric: a rule's ``act_qtype`` is the type of the
*outputs* of the ops in the matched modules, ``weight_qtype`` the type of their
matmul / convolution weights.

========================  ============================================================
``act_qtype``             ``"int8"`` (asymmetric), ``"int16"`` (symmetric, zero point 0:
                          TFLite's 16x8 mode, with int8 weights), None (float output)
``weight_qtype``          ``"int8"`` or ``"int4"`` (symmetric, narrow range, one scale per
                          output channel), None (float weight)
========================  ============================================================

An op no rule matches stays float. Without rules every op is int8, as with
``[Rule()]``. Everything else is what TFLite's kernels fix (per-tensor min/max
activations, per-channel absmax weights, every op of the module, no rotation).

``qflax.QuantizationRule`` objects (any dataclass rule with ``module_path``,
``act_qtype`` and ``weight_qtype``) are still accepted when their other fields
keep their defaults, with a ``DeprecationWarning`` naming the equivalent
:class:`Rule`.

Example:
    >>> from qlitert import rules
    >>> r = rules.check(
    ...     [rules.Rule(module_path="head", act_qtype="int16"), rules.Rule(weight_qtype="int4")]
    ... )
    >>> rules.lookup(r, "head"), rules.lookup(r, "blocks/0/mlp")
    ((0, OpTypes(act='int16', weight='int8')), (1, OpTypes(act='int8', weight='int4')))
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import qcore
import qcore.rules
from qlitert import qdq

# The LiteRT types (qcore names, of qdq.CODES) activations and weights can have.
ACT_TYPES = ("int8", "int16")
WEIGHT_TYPES = ("int8", "int4")
_OWN = ("module_path", "act_qtype", "weight_qtype")
# Fields of other rule types that change nothing in a LiteRT model: its activation
# scales are always static, and a rotation seed does nothing without a rotation.
_IGNORED = ("act_static_scale", "rotation_seed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    """LiteRT types for the ops of the modules that ``module_path`` selects.

    Attributes:
        module_path: Regex fullmatched against the ``/``-joined path of the module
            that computes an op (``".*"``: every module, ``""``: the root), or a
            callable ``path -> bool``. Regexes that can backtrack catastrophically
            are refused (:func:`qcore.rules.check_module_path`).
        act_qtype: Type of the ops' outputs: ``"int8"`` (asymmetric), ``"int16"``
            (symmetric, TFLite's 16x8 kernels, which need int8 weights) or None
            (float). A :class:`qcore.QType` is stored as its name.
        weight_qtype: Type of matmul and convolution weights: ``"int8"`` or
            ``"int4"`` (symmetric, narrow range, per output channel) or None (float).

    Raises:
        ValueError: For another type, int16 activations with int4 weights, or a
            ``module_path`` that is neither a safe regex nor a callable.

    Example:
        >>> import qlitert
        >>> qlitert.Rule(module_path="head", act_qtype="int16")
        Rule(module_path='head', act_qtype='int16', weight_qtype='int8')
        >>> qlitert.Rule(act_qtype="int4")
        Traceback (most recent call last):
        ...
        ValueError: act_qtype='int4': LiteRT activations are one of ['int8', 'int16'] ...
    """

    module_path: str | Callable[[str], bool] = ".*"
    act_qtype: str | qcore.QType | None = "int8"
    weight_qtype: str | qcore.QType | None = "int8"

    def __post_init__(self) -> None:
        qcore.rules.check_module_path(self.module_path)
        act = _type_name("act_qtype", self.act_qtype, ACT_TYPES, "activations")
        weight = _type_name("weight_qtype", self.weight_qtype, WEIGHT_TYPES, "weights")
        if act == "int16" and weight == "int4":
            raise ValueError(
                "act_qtype='int16', weight_qtype='int4': int16 activations need int8 weights "
                "(TFLite's 16x8 kernels); int4 weights go with int8 activations"
            )
        object.__setattr__(self, "act_qtype", act)
        object.__setattr__(self, "weight_qtype", weight)


def _type_name(field: str, value: Any, allowed: tuple[str, ...], what: str) -> str | None:
    """The qtype name of ``value`` (None stays None) if LiteRT has it for ``what``."""
    if value is None:
        return None
    try:
        name = qcore.qtypes.get(value).name
    except (TypeError, ValueError):
        name = value
    if not (isinstance(name, str) and name in allowed):
        raise ValueError(
            f"{field}={name!r}: LiteRT {what} are one of {list(allowed)} or None (float)"
        )
    return name


@dataclasses.dataclass(frozen=True)
class OpTypes:
    """LiteRT types of an op's output and weight: qcore names, or None for float.

    Attributes:
        act: ``"int8"``, ``"int16"`` or ``"int4"`` (a :class:`qcore.QType` is stored
            as its name; TFLite's codes ``"i8"``... are deprecated), or None.
        weight: The same for the op's matmul / convolution weight.

    Raises:
        ValueError: For another type, naming the field, the value and the allowed names.

    Example:
        >>> from qlitert import rules
        >>> rules.OpTypes("int16", "int8")
        OpTypes(act='int16', weight='int8')
    """

    act: str | None
    weight: str | None

    def __post_init__(self) -> None:
        for field in ("act", "weight"):
            value = getattr(self, field)
            if value is not None:
                # Warns where OpTypes(...) was called, past this and __init__.
                name = qdq.qtype_name(value, arg=field, stacklevel=3)
                object.__setattr__(self, field, name)


INT8 = OpTypes("int8", "int8")
FLOAT = OpTypes(None, None)


def check(rules: Sequence[Rule] | Rule | None) -> tuple[Rule, ...]:
    """Validates rules for LiteRT; returns them as a tuple of :class:`Rule` (``()`` for None).

    Other dataclass rules (``qflax.QuantizationRule``) are converted, with a
    ``DeprecationWarning``, if their fields beyond ``module_path``, ``act_qtype``
    and ``weight_qtype`` keep their defaults.

    Raises:
        ValueError: Naming the rule, the field, its value and what is allowed.
    """
    return _check(rules, stacklevel=3)


def _check(rules: Any, stacklevel: int) -> tuple[Rule, ...]:
    """:func:`check`, warning ``stacklevel`` frames up (as for :func:`warnings.warn`)."""
    if rules is None:
        return ()
    rules = [rules] if isinstance(rules, Rule) or _is_rule_like(rules) else list(rules)
    out = tuple(_as_rule(rule, i) for i, rule in enumerate(rules))
    old = [i for i, rule in enumerate(rules) if not isinstance(rule, Rule)]
    if old:
        kind = type(rules[old[0]])
        warnings.warn(
            f"{kind.__module__.split('.')[0]}.{kind.__name__} rules are deprecated in "
            f"qlitert (rules{old}); use qlitert.Rule: "
            + ", ".join(f"qlitert.{out[i]!r}" for i in old),
            DeprecationWarning,
            stacklevel=stacklevel,
        )
    return out


def _is_rule_like(rule: Any) -> bool:
    """A dataclass instance with the fields of a :class:`Rule` (e.g. a qflax rule)."""
    if not dataclasses.is_dataclass(rule) or isinstance(rule, type):
        return False
    return set(_OWN) <= {f.name for f in dataclasses.fields(rule)}


def _as_rule(rule: Any, i: int) -> Rule:
    """``rules[i]`` as a :class:`Rule`; other rule types only with LiteRT's fixed defaults."""
    if isinstance(rule, Rule):
        return rule
    if not _is_rule_like(rule):
        raise ValueError(
            f"rules[{i}]={rule!r} is not a qlitert.Rule (nor a deprecated "
            "qflax.QuantizationRule); allowed: qlitert.Rule(module_path=..., act_qtype=..., "
            "weight_qtype=...)"
        )
    try:
        converted = Rule(**{name: getattr(rule, name) for name in _OWN})
    except ValueError as err:
        raise ValueError(f"rules[{i}].{err}") from None
    for field in dataclasses.fields(rule):
        if field.name in _OWN or field.name in _IGNORED:
            continue
        value, default = _tupled(getattr(rule, field.name)), _tupled(_default(field))
        if value != default:
            keep = (
                "qlitert reads only module_path, act_qtype and weight_qtype"
                if default is dataclasses.MISSING
                else f"leave it at {default!r}"
            )
            raise ValueError(
                f"rules[{i}].{field.name}={getattr(rule, field.name)!r}: LiteRT fixes this "
                f"(per-tensor min/max activations, per-channel absmax weights, every op "
                f"of the module, no rotation); {keep}"
            )
    return converted


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _tupled(value: Any) -> Any:
    """Lists as tuples, so that a normalised field compares equal to its default."""
    return tuple(value) if isinstance(value, list | tuple) else value


def lookup(rules: tuple[Rule, ...], path: str) -> tuple[int | None, OpTypes]:
    """The first rule matching ``path`` (its index, or None) and the types it gives.

    Without rules every op is int8; with rules, an op none matches is float.
    """
    if not rules:
        return None, INT8
    i = qcore.rules.first_match(rules, path)
    if i is None:
        return None, FLOAT
    act, weight = (
        None if t is None else qcore.qtypes.get(t).name
        for t in (rules[i].act_qtype, rules[i].weight_qtype)
    )
    return i, OpTypes(act, weight)
