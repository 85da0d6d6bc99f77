"""Global switches, read from the environment at import and settable at run time.

Attributes:
    REINIT_ON_STATE_DICT_LOAD: After :meth:`~qtorchlike.nn.Module.load_state_dict`
        assigns new weights, weight quantizers whose scales are initialised from
        weight statistics re-initialise them from the new weights (default
        ``True``; environment variable ``QTORCHLIKE_REINIT_ON_STATE_DICT_LOAD``).
    IGNORE_MISSING_KEYS: ``load_state_dict(strict=True)`` tolerates keys the
        checkpoint lacks, e.g. quantizer scales when loading a float checkpoint
        (default ``False``; environment variable ``QTORCHLIKE_IGNORE_MISSING_KEYS``).

Example:
    >>> import qtorchlike
    >>> qtorchlike.config.REINIT_ON_STATE_DICT_LOAD
    True
"""

from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ValueError(
        f"environment variable {name}={raw!r} is not a boolean; allowed: "
        f"{sorted(_TRUE)} or {sorted(_FALSE - {''})}"
    )


REINIT_ON_STATE_DICT_LOAD: bool = _flag("QTORCHLIKE_REINIT_ON_STATE_DICT_LOAD", True)
IGNORE_MISSING_KEYS: bool = _flag("QTORCHLIKE_IGNORE_MISSING_KEYS", False)
