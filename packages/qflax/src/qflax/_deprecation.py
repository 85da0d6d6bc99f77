"""Deprecated names that forward to their new homes with a ``DeprecationWarning``."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def forward(old: str, new: str, names: Sequence[str], renamed: Mapping[str, str] | None = None):
    """A module ``__getattr__`` for the deprecated module ``old``: ``names`` come from ``new``.

    Args:
        old: The deprecated module's name.
        new: The module that now holds the names.
        names: The deprecated module's public names.
        renamed: ``{old name: new name}`` for names that changed too.
    """
    renamed = dict(renamed or {})

    def getattr_(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        target = renamed.get(name, name)
        value = getattr(importlib.import_module(new), target)
        warnings.warn(
            f"{old}.{name} is deprecated; use {new}.{target}", DeprecationWarning, stacklevel=2
        )
        return value

    return getattr_


def old_name(module: str, old: str, new: str, value: Any) -> Callable[[str], Any]:
    """A module ``__getattr__`` that answers the old name ``old`` of ``module.new``."""

    def getattr_(name: str) -> Any:
        if name != old:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{old} is deprecated; use {module}.{new}", DeprecationWarning, stacklevel=2
        )
        return value

    return getattr_
