"""The independent oracle of the layout tests: a plain training loop on one process."""

from __future__ import annotations

from typing import Any

import mpdl.autograd.functional as F
from mpdl.autograd import Tensor, optim


def adam_losses(model: Any, x: Any, y: Any, steps: int, lr: float) -> list[float]:
    """The loss of each of `steps` full-batch Adam steps of model on (x, y)."""
    opt = optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(Tensor(x)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.item()))
    return losses
