"""Providers: what happens to the ops that rules select (PTQ, QAT, LoRA/QLoRA).

The public names are re-exported from :mod:`qflax`.
"""

from qflax.providers._base import Provider, SiteVars
from qflax.providers._lora import LoraParam, LoraProvider, LoraRule
from qflax.providers._ptq import PtqProvider
from qflax.providers._qat import QtProvider

__all__ = [
    "LoraParam",
    "LoraProvider",
    "LoraRule",
    "Provider",
    "PtqProvider",
    "QtProvider",
    "SiteVars",
]
