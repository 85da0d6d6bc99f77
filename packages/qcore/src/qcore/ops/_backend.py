"""Which backend qcore's ops are traced for: the seam for backend-tuned code paths.

The blocked kernels of :mod:`qcore.ops.kernels` and the dequantize-first row thresholds
of :mod:`qcore.ops.dot_general` were tuned by reading XLA:CPU's compiled code; they
apply when :func:`platform` is ``"cpu"``. Any other platform takes the generic path.
"""

import jax


def platform() -> str:
    """The platform (``"cpu"``, ``"gpu"``, ``"tpu"``...) a computation traced now runs on.

    It is read when an op is traced, from what JAX itself uses to place a computation
    whose operands are not committed to a device: the default device if one is set
    (``jax.default_device(...)``, a device or a platform name), else the default
    backend (``jax.default_backend()``). Both are part of ``jax.jit``'s cache key,
    so a function traced under one is not reused under another.

    Operands committed to a device of another platform (``jax.device_put`` to a
    GPU while the default backend is the CPU) are not consulted: ``jax.jit`` traces
    once per shape and dtype, whatever the placement, so the placement is not known
    at trace time. The same holds for ``jax.export`` to another platform. Such
    computations take the default platform's path, which computes the same values
    within float32 rounding; only its speed was tuned for another machine.

    Returns:
        The platform name, as in ``jax.Device.platform``.

    Example:
        >>> import jax
        >>> from qcore.ops import _backend
        >>> _backend.platform() == jax.default_backend()
        True
        >>> with jax.default_device("tpu"):
        ...     _backend.platform()
        'tpu'
    """
    device = jax.config.jax_default_device  # pyright: ignore[reportAttributeAccessIssue]
    if device is None:
        return jax.default_backend()
    return device if isinstance(device, str) else device.platform
