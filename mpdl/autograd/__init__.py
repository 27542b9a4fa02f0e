"""Reverse-mode automatic differentiation over NumPy/CuPy arrays: Tensor, ops, layers, optimizers."""

from mpdl.autograd.gradcheck import GradcheckError, gradcheck
from mpdl.autograd.recompute import checkpoint
from mpdl.autograd.tensor import Function, Tensor, enable_grad, is_grad_enabled, no_grad

__all__ = [
    "Function",
    "GradcheckError",
    "Tensor",
    "checkpoint",
    "enable_grad",
    "gradcheck",
    "is_grad_enabled",
    "no_grad",
]
