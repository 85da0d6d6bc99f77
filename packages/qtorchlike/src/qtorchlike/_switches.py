"""The model-wide switches the modes and the exports save, set and restore.

Internal: :mod:`qtorchlike.modes` and :mod:`qtorchlike.export` share it.
"""

from __future__ import annotations

from typing import Any

from qtorchlike._proxy import QuantProxy
from qtorchlike.nn.module import Module


def check_model(model: Any, fn: str) -> None:
    """Raises TypeError naming ``fn`` unless ``model`` is a :class:`qtorchlike.nn.Module`."""
    if not isinstance(model, Module):
        raise TypeError(
            f"{fn}(model={type(model).__name__}): model must be a qtorchlike.nn.Module "
            "(e.g. a qnn.Sequential of quantized layers)"
        )


class Switches:
    """Saves attributes of a model's modules and puts them back.

    Records every module's ``training`` flag, every quantizer proxy's ``enabled``
    and ``calibrating`` switches and every ``return_quant_tensor`` attribute, so
    that :meth:`restore` undoes whatever a mode (or the user inside it) changed.
    """

    def __init__(self, model: Module) -> None:
        self.saved: list[tuple[Module, str, Any]] = []
        for m in model.modules():
            self.saved.append((m, "training", m.training))
            for attr in ("enabled", "calibrating", "return_quant_tensor"):
                if attr in m.__dict__:
                    self.saved.append((m, attr, m.__dict__[attr]))

    def plain_outputs(self) -> None:
        """Makes every layer return arrays: with quantizers off there are no QuantTensors."""
        for m, attr, _ in self.saved:
            if attr == "return_quant_tensor":
                object.__setattr__(m, attr, False)

    def restore(self) -> None:
        """Puts every recorded attribute back."""
        for m, attr, value in self.saved:
            object.__setattr__(m, attr, value)


def proxies(model: Module) -> list[QuantProxy]:
    """Every quantizer proxy of ``model``."""
    return [m for m in model.modules() if isinstance(m, QuantProxy)]
