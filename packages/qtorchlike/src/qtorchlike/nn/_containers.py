"""Plain (float) building blocks that quantized models mix in: containers, pooling, dropout."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from qtorchlike import functional as F
from qtorchlike.nn.module import Module


class Sequential(Module):
    """Calls its modules in order; they are named ``"0"``, ``"1"``, ...

    Example:
        >>> import jax.numpy as jnp
        >>> import qtorchlike.nn as qnn
        >>> model = qnn.Sequential(qnn.QuantLinear(4, 8), qnn.QuantReLU(), qnn.QuantLinear(8, 2))
        >>> model(jnp.ones((1, 4))).shape
        (1, 2)
        >>> [name for name, _ in model.named_children()]
        ['0', '1', '2']
    """

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        for i, m in enumerate(modules):
            if not isinstance(m, Module):
                raise TypeError(
                    f"Sequential argument {i} is a {type(m).__name__}; allowed: "
                    "qtorchlike.nn.Module instances (e.g. qnn.QuantLinear(4, 2))"
                )
            setattr(self, str(i), m)

    def __getitem__(self, i: int) -> Module:
        return list(self.children())[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self.children()))

    def forward(self, x: Any) -> Any:  # noqa: D102
        for m in self.children():
            x = m(x)
        return x


class ModuleList(Module):
    """A list of modules registered as ``"0"``, ``"1"``, ..."""

    def __init__(self, modules: Iterable[Module] = ()) -> None:
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> ModuleList:
        """Adds a module at the end."""
        setattr(self, str(len(self._modules)), module)
        return self

    def __getitem__(self, i: int) -> Module:
        return list(self.children())[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self.children()))


class Identity(Module):
    """Returns its input."""

    def forward(self, x: Any) -> Any:  # noqa: D102
        return x


class Flatten(Module):
    """Flattens dims ``start_dim..end_dim`` (keeps a per-tensor QuantTensor)."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x: Any) -> Any:  # noqa: D102
        return F.flatten(x, self.start_dim, self.end_dim)


class Dropout(Module):
    """Zeroes elements with probability ``p`` in training and rescales the rest."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"p={p!r} must be in [0, 1)")
        self.p = float(p)

    def forward(self, x: Any) -> Any:  # noqa: D102
        return F.dropout(x, self.p, self.training)


class ReLU(Module):
    """Float ReLU (keeps a QuantTensor's grid)."""

    def forward(self, x: Any) -> Any:  # noqa: D102
        return F.relu(x)


class MaxPool2d(Module):
    """Max pooling over NCHW inputs (keeps a QuantTensor's grid)."""

    def __init__(self, kernel_size: Any, stride: Any = None, padding: int = 0) -> None:
        super().__init__()
        F._pair(kernel_size, "kernel_size")
        F._pair(kernel_size if stride is None else stride, "stride")
        F._pair(padding, "padding", lowest=0)
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding

    def forward(self, x: Any) -> Any:  # noqa: D102
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding)


class AvgPool2d(Module):
    """Average pooling over NCHW inputs (a plain array out; see TruncAvgPool2d)."""

    def __init__(self, kernel_size: Any, stride: Any = None) -> None:
        super().__init__()
        F._pair(kernel_size, "kernel_size")
        F._pair(kernel_size if stride is None else stride, "stride")
        self.kernel_size, self.stride = kernel_size, stride

    def forward(self, x: Any) -> Any:  # noqa: D102
        out = F.avg_pool2d(x, self.kernel_size, self.stride)
        return out.value if hasattr(out, "value") else out
