"""Deprecated module path: the providers live in :mod:`qflax` (``qflax.PtqProvider``...).

Kept so that ``from qflax.provider import PtqProvider`` keeps working.
"""

from qflax.providers._base import Provider
from qflax.providers._ptq import PtqProvider
from qflax.providers._qat import QtProvider

__all__ = ["Provider", "PtqProvider", "QtProvider"]
