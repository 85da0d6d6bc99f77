"""LoRA and QLoRA adapters; see :class:`qflax.LoraProvider` and :class:`qflax.LoraRule`.

This module keeps the import path of the LoRA names and the helpers that split
and merge LoRA params (:func:`split_params`, :func:`merge_params`,
:func:`is_lora_param`); the implementation is :mod:`qflax.providers._lora`.
"""

from qflax.providers._lora import (
    LORA_OP_NAMES,
    LORA_SUFFIXES,
    LoraParam,
    LoraProvider,
    LoraRule,
    is_lora_param,
    merge_params,
    split_params,
)

__all__ = [
    "LORA_OP_NAMES",
    "LORA_SUFFIXES",
    "LoraParam",
    "LoraProvider",
    "LoraRule",
    "is_lora_param",
    "merge_params",
    "split_params",
]
