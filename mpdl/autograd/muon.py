"""Muon (Jordan et al. 2024) with Moonlight's update scaling (Liu et al. 2025), naive: one rank,
whole matrices. `mpdl.autograd.optim.Muon` is the same step on any layout.

For each 2-D hidden weight W (A × B) with gradient G and momentum buffer M:

    M ← μM + G;   U = G + μM                    (Nesterov momentum)
    O = NS₅(U)                                  (≈ the orthogonal factor of U = PΣQᵀ: PQᵀ)
    W ← W(1 - lr·λ) - lr·0.2·√max(A, B)·O       (update RMS 0.2, as AdamW's: lr and λ carry over)

NS₅ is five quintic Newton–Schulz iterations X ← aX + (bS + cS²)X with S = XXᵀ, from X = U/‖U‖
(in float32), which push every singular value of U towards 1. Every other parameter (lookup
tables, biases, norms) takes AdamW's step.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mpdl.autograd.tensor import Tensor
from mpdl.backend import get_array_module

#: the quintic's (a, b, c): the steepest rise at 0 that still keeps singular values near 1
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def newton_schulz(u: Any, steps: int = NS_STEPS) -> Any:
    """NS₅(u): the 2-D array u with its singular values pushed towards 1, in float32."""
    xp = get_array_module(u)
    x = u.astype(np.float32)
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T  # S = XXᵀ is the smaller Gram matrix
    x = x / (xp.linalg.norm(x) + np.float32(1e-7))
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * (s @ s)) @ x
    return x if wide else x.T


def rms_scale(shape: tuple[int, ...]) -> float:
    """Moonlight's factor 0.2·√max(A, B): an orthogonal A × B update has RMS 1/√max(A, B)."""
    return 0.2 * math.sqrt(max(shape))


def is_hidden_matrix(p: Tensor) -> bool:
    """Whether Muon updates p: a 2-D parameter that is not a lookup table."""
    return len(p.shape) == 2 and not getattr(p, "lookup_table", False)


class NaiveMuon:
    """Muon on the hidden matrices of `params`, AdamW on the others (decay on 2-D ones only)."""

    def __init__(self, params: list[Tensor], lr: float = 1e-3, momentum: float = 0.95,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.state: dict[int, dict[str, Any]] = {id(p): {} for p in self.params}

    def step(self) -> None:
        """Update every parameter that has a gradient."""
        for p in self.params:
            if p.grad is None:
                continue
            state, g, xp = self.state[id(p)], p.grad, get_array_module(p.data)
            if len(p.shape) >= 2:
                p.data *= 1 - self.lr * self.weight_decay
            if is_hidden_matrix(p):
                m = state.setdefault("momentum_buffer", xp.zeros_like(g))
                m *= self.momentum
                m += g
                u = newton_schulz(g + self.momentum * m)
                p.data -= (self.lr * rms_scale(p.shape) * u).astype(p.dtype)
                continue
            b1, b2 = self.betas
            t = state["step"] = state.get("step", 0) + 1
            m = state["exp_avg"] = b1 * state.get("exp_avg", 0) + (1 - b1) * g
            v = state["exp_avg_sq"] = b2 * state.get("exp_avg_sq", 0) + (1 - b2) * g * g
            p.data -= self.lr * (m / (1 - b1**t)) / (xp.sqrt(v / (1 - b2**t)) + self.eps)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
