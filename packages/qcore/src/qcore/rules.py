r"""Rules selected by module path: a safe regex check, first-match lookup, unused rules.

Framework-free (pure Python and :mod:`re`): qflax's and qlitert's rules both match
here. A rule is any object with a ``module_path``: a regex that must match the
whole ``/``-joined path of a module (integer indices included, e.g.
``r"layers/\d+/mlp"``), or a callable ``path -> bool``. :func:`check_module_path`
refuses regexes whose matching can backtrack catastrophically (rules are also
read from files). A :class:`RuleMatcher` applies rules with first-match-wins
precedence and remembers which ones ever matched, so a typo in a path shows up
as an unused rule instead of a silently unquantized model.

Example:
    >>> import dataclasses
    >>> from qcore import rules
    >>> @dataclasses.dataclass(frozen=True)
    ... class Rule:
    ...     module_path: str
    ...     bits: int
    >>> m = rules.RuleMatcher([Rule("head", 8), Rule(r"layers/\d+/.*", 4), Rule("hed", 2)])
    >>> m.match("layers/3/mlp").bits, m.match("head").bits, m.match("embed")
    (4, 8, None)
    >>> [r.module_path for r in m.unused_rules()]
    ['hed']
    >>> rules.check_module_path("(a+)+$")
    Traceback (most recent call last):
    ...
    ValueError: module_path='(a+)+$' has a repeat inside a repeated group (e.g. (a+)+), ...
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Callable, Collection, Iterable, Sequence
from re import _parser as _sre_parser  # pyright: ignore[reportAttributeAccessIssue]
from typing import Any, Generic, Protocol, TypeVar

__all__ = [
    "PathRule",
    "RuleMatcher",
    "check_module_path",
    "first_match",
    "path_matches",
    "warn_unused",
]

ModulePath = str | Callable[[str], bool]


class PathRule(Protocol):
    """A rule as this module sees it: anything with a ``module_path``."""

    @property
    def module_path(self) -> ModulePath:
        """Regex fullmatched against a module's path, or a callable ``path -> bool``."""
        ...


R = TypeVar("R", bound=PathRule)

# Regex nodes that repeat their body (sre's parse tree), and the bound of "unbounded".
_REPEATS = ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
_MAX_REPEATS = 4


def check_module_path(value: Any) -> None:
    r"""Refuses a ``module_path`` that is neither a safe regex string nor a callable.

    Rules come from files (checkpoints), so a pattern must not be able to hang the
    matcher: a repeated group may not contain another repeat or an alternation (the
    exponential cases like ``(a+)+$`` and ``(a|a)*$``), backreferences are refused, and
    at most four repeats bound the polynomial cost of ``.*.*.*...``.

    Raises:
        ValueError: Naming the value and what is allowed: for a regex that does not
            compile, one that can backtrack catastrophically, or a value that is
            neither a string nor a callable.

    Example:
        >>> from qcore.rules import check_module_path
        >>> check_module_path(r"(layers|blocks)/\d+/.*")  # fine
        >>> check_module_path(3)
        Traceback (most recent call last):
        ...
        ValueError: module_path=3 must be a regex string or a callable
    """
    if not isinstance(value, str):
        if not callable(value):
            raise ValueError(f"module_path={value!r} must be a regex string or a callable")
        return
    try:
        tree = _sre_parser.parse(value)
    except re.error as err:
        raise ValueError(f"module_path={value!r} is not a valid regex: {err}") from None
    repeats = 0
    problem = None
    stack: list[tuple[Any, bool]] = [(tree, False)]
    while stack and problem is None:
        items, repeated = stack.pop()
        for op, arg in items:
            name = str(op)
            if name in _REPEATS:
                _, hi, body = arg
                if hi > 1:
                    repeats += 1
                    if repeated:
                        problem = "a repeat inside a repeated group (e.g. (a+)+)"
                stack.append((body, repeated or hi > 1))
            elif name == "BRANCH":
                if repeated:
                    problem = "an alternation inside a repeated group (e.g. (a|ab)*)"
                stack.extend((b, repeated) for b in arg[1])
            elif name in ("GROUPREF", "GROUPREF_EXISTS"):
                problem = "a backreference"
            elif name in ("SUBPATTERN", "ASSERT", "ASSERT_NOT"):
                stack.append((arg[-1], repeated))
            elif name == "ATOMIC_GROUP":
                stack.append((arg, repeated))
    if problem is None and repeats > _MAX_REPEATS:
        problem = f"{repeats} repeats"
    if problem is not None:
        raise ValueError(
            f"module_path={value!r} has {problem}, which can make matching very slow "
            f"(catastrophic backtracking); allowed: regexes without nested repeats, alternations "
            f"inside repeats or backreferences, with at most {_MAX_REPEATS} repeats "
            "(e.g. r'layers/\\d+/.*'), or a callable"
        )


def path_matches(module_path: ModulePath, path: str) -> bool:
    r"""Whether ``module_path`` (a regex matching the whole path, or a callable) selects ``path``.

    Example:
        >>> from qcore.rules import path_matches
        >>> path_matches(r"layers/\d+", "layers/12"), path_matches("layers", "layers/12")
        (True, False)
        >>> path_matches(lambda p: p.endswith("attn"), "block/attn")
        True
    """
    if callable(module_path):
        return bool(module_path(path))
    return re.fullmatch(module_path, path) is not None


def _path_applies(rule: PathRule, path: str, *context: Any) -> bool:
    return path_matches(rule.module_path, path)


def first_match(
    rules: Sequence[R], path: str, *context: Any, applies: Callable[..., bool] | None = None
) -> int | None:
    """The index of the first rule that applies to ``path``, or None.

    Args:
        rules: The rules, in precedence order.
        path: The module's ``/``-joined path.
        *context: Passed on to ``applies`` (e.g. qflax's op name).
        applies: ``applies(rule, path, *context) -> bool``; by default a rule applies
            when its ``module_path`` matches ``path`` (:func:`path_matches`).
    """
    test = applies or _path_applies
    return next((i for i, rule in enumerate(rules) if test(rule, path, *context)), None)


def _unused_message(index: int, rule: PathRule) -> str:
    return f"rules[{index}] (module_path={rule.module_path!r}) matched no op"


def warn_unused(
    rules: Iterable[R],
    used: Collection[int],
    message: Callable[[int, R], str] | None = None,
    stacklevel: int = 1,
) -> None:
    """Warns (``UserWarning``) about every rule whose index is not in ``used``.

    Args:
        rules: The rules.
        used: Indices of the rules that matched something.
        message: ``message(index, rule)``, the text of each warning; by default
            ``"rules[i] (module_path=...) matched no op"``.
        stacklevel: As for :func:`warnings.warn`, counted from the caller of this
            function (1: the line that calls it).
    """
    describe = message or _unused_message
    for i, rule in enumerate(rules):
        if i not in used:
            warnings.warn(describe(i, rule), UserWarning, stacklevel=stacklevel + 1)


class RuleMatcher(Generic[R]):
    """First-match-wins lookup over rules that records which were used (thread-safe).

    Args:
        rules: The rules, in precedence order (any objects with a ``module_path``).
        applies: ``applies(rule, path, *context) -> bool``, whether a rule applies
            to an op (e.g. qflax also filters by op name); by default a rule
            applies when its ``module_path`` matches the path.
    """

    def __init__(self, rules: Iterable[R], applies: Callable[..., bool] | None = None) -> None:
        self.rules: list[R] = list(rules)
        self._applies = applies
        self._used: set[int] = set()
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """Pickles the rules and the record of used rules (not the lock)."""
        with self._lock:
            copies = {"_used": set(self._used), "_warned": set(self._warned)}
            return {**vars(self), **copies, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state, _lock=threading.Lock())

    def match(self, path: str, *context: Any) -> R | None:
        """The first rule that applies to ``path`` (and ``context``), or None."""
        i = first_match(self.rules, path, *context, applies=self._applies)
        if i is None:
            return None
        with self._lock:
            self._used.add(i)
        return self.rules[i]

    def warn_once(self, key: str, message: str, stacklevel: int = 1) -> None:
        """Warns (``UserWarning``) ``message`` the first time this matcher sees ``key``.

        Args:
            key: What the warning is about (e.g. a param path); later calls with it
                say nothing.
            message: The warning's text.
            stacklevel: As for :func:`warnings.warn`, counted from the caller of
                this method (1: the line that calls it).
        """
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)

    def unused_rules(self) -> list[R]:
        """Rules that have not matched anything so far."""
        with self._lock:
            return [r for i, r in enumerate(self.rules) if i not in self._used]

    def warn_unused(
        self, message: Callable[[int, R], str] | None = None, stacklevel: int = 1
    ) -> None:
        """Warns (``UserWarning``) about every rule that matched nothing (see :func:`warn_unused`).

        Args:
            message: ``message(index, rule)``, the text of each warning.
            stacklevel: As for :func:`warnings.warn`, counted from the caller of
                this method (1: the line that calls it).
        """
        with self._lock:
            used = set(self._used)
        warn_unused(self.rules, used, message, stacklevel=stacklevel + 1)
