"""A linear layer and the GELU after it as one graph node: gelu(x Wᵀ + b).

The bias is added inside the GELU kernel, and backward sums the bias gradient inside the GELU
derivative's kernel (the epilogues cuBLASLt calls GELU_BIAS and DGELU_BGRAD). Against a linear
layer followed by ``gelu``, a step makes one pass fewer over the hidden activations in forward
(the bias add) and one fewer in backward (the bias gradient's column sum), saves the same arrays
and gives the same bits.
"""

from __future__ import annotations

from typing import Any

from mpdl.autograd import amp, fused
from mpdl.autograd.tensor import Function, Tensor


def _fold(x: Any) -> Any:
    """``x`` with its leading axes merged: (..., n) -> (m, n)."""
    return x.reshape(-1, x.shape[-1])


class LinearGELU(Function):
    def forward(self, x, w, b):
        if x.shape[-1] != w.shape[1]:
            raise ValueError(f"linear_gelu: input shape {tuple(x.shape)} does not fit weight "
                             f"shape {tuple(w.shape)} (expected input[..., {w.shape[1]}])")
        self.x, self.w, self.b, self.dtype = x, w, b, amp.compute_dtype(w)
        self.h = amp.matmul(_fold(x), w.T, self.dtype)  # the pre-activation, less the bias
        return fused.bias_gelu(self.h, b).reshape(x.shape[:-1] + (w.shape[0],))

    def backward(self, grad):
        x, w, dtype = self.x, self.w, self.dtype
        need_x, need_w, need_b = self.needs_input_grad
        gh, gb = fused.bias_gelu_backward(_fold(grad), self.h, self.b)
        gx = amp.matmul(gh, w, dtype).reshape(x.shape) if need_x else None
        gw = amp.matmul(gh.T, _fold(x), dtype) if need_w else None
        return gx, gw, gb if need_b else None


def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """gelu(x @ weight.T + bias) (the exact GELU, x·Φ(x)), with weight (out_features,
    in_features) and bias (out_features,): the same values as ``gelu(linear(x, weight, bias))``
    in one node."""
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if not isinstance(t, Tensor):
            raise TypeError(f"linear_gelu: {name} must be a Tensor, not {type(t).__name__}")
    if weight.ndim != 2 or bias.shape != (weight.shape[0],):
        raise ValueError(f"linear_gelu: weight must be (out, in) and bias (out,), got shapes "
                         f"{weight.shape} and {bias.shape}")
    return LinearGELU.apply(x, weight, bias)
