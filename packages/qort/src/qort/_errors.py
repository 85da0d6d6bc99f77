"""qort's exception classes."""

from __future__ import annotations


class ExportError(ValueError):
    """The model cannot be exported as asked: an unsupported op, format or argument.

    The message names the op (and where in the model it was traced) or the argument,
    the value, and what is allowed.
    """


class ExportWarning(UserWarning):
    """The export is right but runs slower than it could.

    Such as weight-only products ONNX Runtime does not fuse into ``MatMulNBits``.
    """


class ValidationError(RuntimeError):
    """The exported graph disagrees with JAX beyond the validation rule.

    ``report`` holds the full :class:`~qort.ValidationReport`; the message names
    the first op that disagrees.
    """

    def __init__(self, message: str, report: object) -> None:
        super().__init__(message)
        self.report = report


def kind(value: object) -> str:
    """What ``value`` is, for messages: ``"None"``, ``"an int"``, ``"a str"``."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"
