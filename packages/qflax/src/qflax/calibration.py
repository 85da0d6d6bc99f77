"""Deprecated name of :mod:`qflax.layer_stats` (kept for existing code).

Its names are reachable here with a ``DeprecationWarning``; ``Site`` is now
:class:`qflax.layer_stats.WeightUse`.
"""

from qflax._deprecation import forward

_NAMES = ("SUPPORTED_OPS", "LayerStats", "Site", "collect", "stats_or_collect")
__getattr__ = forward(__name__, "qflax.layer_stats", _NAMES, {"Site": "WeightUse"})
