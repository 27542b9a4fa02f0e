"""Numerical gradient checking by central differences in float64."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mpdl.autograd.tensor import Tensor, no_grad
from mpdl.backend import get_array_module


class GradcheckError(AssertionError):
    """An analytic gradient disagrees with its central-difference estimate."""


def gradcheck(f: Callable[..., Tensor], *inputs: Any, eps: float = 1e-6, atol: float = 1e-5,
              rtol: float = 1e-3, seed: int = 0, raise_exception: bool = True) -> bool:
    """Check the gradients of ``f`` at ``inputs`` against central differences.

    Every floating-point input (Tensor or array) becomes a float64 leaf that requires grad; other
    inputs (integer labels, Python values) pass through unchanged. With a fixed random cotangent
    ``r`` (from ``seed``), the backward gradient of ``sum(f(*inputs) * r)`` must match
    ``(L(x + eps) - L(x - eps)) / 2eps`` element by element within ``atol + rtol * |numeric|``.
    Returns True, or raises ``GradcheckError`` (returns False when ``raise_exception=False``).
    """
    args: list[Any] = []
    checked: list[int] = []
    for i, value in enumerate(inputs):
        data = value.data if isinstance(value, Tensor) else value
        if hasattr(data, "dtype") and data.dtype.kind == "f":
            xp = get_array_module(data)
            args.append(Tensor(xp.array(data, dtype=np.float64), requires_grad=True))
            checked.append(i)
        else:
            args.append(value)
    if not checked:
        raise ValueError("gradcheck: no floating-point input to check")

    out = f(*args)
    if not isinstance(out, Tensor):
        raise TypeError(f"gradcheck: f must return a Tensor, not {type(out).__name__}")
    xp = get_array_module(out.data)
    cotangent = xp.asarray(np.random.default_rng(seed).standard_normal(out.shape))

    def objective() -> float:
        with no_grad():
            return float((f(*args).data * cotangent).sum())

    (out * Tensor(cotangent)).sum().backward()
    for i in checked:
        t = args[i]
        analytic = t.grad if t.grad is not None else xp.zeros_like(t.data)
        analytic = np.asarray(analytic.get() if xp is not np else analytic).reshape(-1)
        flat = t.data.reshape(-1)
        numeric = np.empty(flat.size)
        for k in range(flat.size):
            original = float(flat[k])
            flat[k] = original + eps
            plus = objective()
            flat[k] = original - eps
            minus = objective()
            flat[k] = original
            numeric[k] = (plus - minus) / (2 * eps)
        error = np.abs(analytic - numeric)
        bad = error > atol + rtol * np.abs(numeric)
        if bad.any():
            k = int(np.argmax(error - rtol * np.abs(numeric)))
            message = (f"gradcheck: input {i} (shape {t.shape}): analytic and numeric gradients "
                       f"differ at flat index {k}: analytic {analytic[k]:.8g}, numeric "
                       f"{numeric[k]:.8g} ({int(bad.sum())} of {flat.size} elements off, "
                       f"max abs error {error.max():.3g})")
            if raise_exception:
                raise GradcheckError(message)
            return False
    return True
