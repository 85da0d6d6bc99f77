"""Deprecated name of :mod:`qflax.presets` (kept for existing code).

Its names are reachable here with a ``DeprecationWarning``; ``RecipeRow`` is now
:class:`qflax.presets.OpChoice`.
"""

from qflax._deprecation import forward

_NAMES = ("DEFAULT_CANDIDATES", "DEFAULT_TILES", "LOOKUP", "FourBitResult", "RecipeRow", "four_bit")
__getattr__ = forward(__name__, "qflax.presets", _NAMES, {"RecipeRow": "OpChoice"})
