"""The pre-norm transformer block's residual structure, shared by the GPT's block and its
tensor-parallel version: x + attn(ln1(x)), then + mlp(ln2(x)), optionally recomputed in backward."""

from __future__ import annotations

from mpdl.autograd import nn
from mpdl.autograd.recompute import checkpoint
from mpdl.autograd.tensor import Tensor
from mpdl.models.moe import MoE


class ResidualBlock(nn.Module):
    """A block with sublayers `ln1`, `attn`, `ln2`, `mlp` (set by the subclass) and `recompute`:
    when true, only the block's input is kept and the rest is recomputed in backward; a mixture
    of experts keeps what it saves (its routing and all-to-alls are not run again), so only the
    attention sublayer is recomputed there (docs/moe.md)."""

    recompute: bool = False

    def forward(self, x: Tensor) -> Tensor:
        if not self.recompute:
            return self.residual(x)
        if isinstance(self.mlp, MoE):
            x = checkpoint(self.attention_residual, x)
            return x + self.mlp(self.ln2(x))
        return checkpoint(self.residual, x)

    def attention_residual(self, x: Tensor) -> Tensor:
        """x + attn(ln1(x)): the block's first sublayer."""
        return x + self.attn(self.ln1(x))

    def residual(self, x: Tensor) -> Tensor:
        """The block without recomputation."""
        x = self.attention_residual(x)
        return x + self.mlp(self.ln2(x))
