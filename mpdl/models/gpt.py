"""A GPT language model (decoder-only transformer) in one file, after minGPT and nanoGPT.

    x = token_embedding(idx) + position_embedding(0..T-1)
    for each block:  x = x + attn(ln1(x));  x = x + mlp(ln2(x))
    logits = ln_f(x) @ token_embedding.weightᵀ          (output projection tied to the input)

Attention is causal multi-head self-attention with one fused ``qkv`` projection; the MLP is
Linear(n_embd, 4·n_embd) → GELU → Linear(4·n_embd, n_embd). Parameter names say what they are:
``token_embedding.weight``, ``position_embedding.weight``, ``blocks.0.ln1.weight``,
``blocks.0.attn.qkv.weight``, ``blocks.0.attn.proj.weight``, ``blocks.0.mlp.fc.weight``,
``blocks.0.mlp.proj.weight``, ``ln_f.weight``, … Initialisation follows GPT-2: weights N(0, 0.02)
(the residual projections N(0, 0.02/√(2·n_layer))), biases zero, LayerNorm scale one.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import mpdl.autograd.functional as F
from mpdl.autograd import Tensor, nn, no_grad
from mpdl.autograd.recompute import checkpoint
from mpdl.backend import get_array_module, to_host
from mpdl.models.attention import packed_attention
from mpdl.models.block import ResidualBlock
from mpdl.models.moe import MoE, MoESettings

#: --recompute: nothing, the attention core (Korthikanti et al. 2022's selective), each block
RECOMPUTE = ("none", "selective", "full")


def causal_attention(qkv: Tensor) -> Tensor:
    """The attention core: softmax(q kᵀ/√d, causal) v of the heads packed in qkv (B, T, 3, H, hd),
    as (B, T, H, hd)."""
    return packed_attention(qkv, is_causal=True)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions 0..t only."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, rng: np.random.Generator,
                 dtype: Any) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, rng=rng, dtype=dtype)
        self.proj = nn.Linear(n_embd, n_embd, rng=rng, dtype=dtype)
        self.dropout = nn.Dropout(dropout, rng=rng)
        self.recompute_core = False  # recompute the attention core in backward

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        h = self.n_head
        qkv = self.qkv(x).reshape(b, t, 3, h, c // h)
        y = checkpoint(causal_attention, qkv) if self.recompute_core else causal_attention(qkv)
        return self.dropout(self.proj(y.reshape(b, t, c)))


class MLP(nn.Module):
    """Linear → GELU → Linear with a 4× wider hidden layer."""

    def __init__(self, n_embd: int, dropout: float, rng: np.random.Generator, dtype: Any) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, rng=rng, dtype=dtype)
        self.proj = nn.Linear(4 * n_embd, n_embd, rng=rng, dtype=dtype)
        self.dropout = nn.Dropout(dropout, rng=rng)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(self.fc(x, activation="gelu")))


class Block(ResidualBlock):
    """A pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(x)); with `moe`, the
    MLP is a mixture of experts (`mpdl.models.moe.MoE`)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, rng: np.random.Generator,
                 dtype: Any, moe: MoESettings | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd, dtype=dtype)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, rng, dtype)
        self.ln2 = nn.LayerNorm(n_embd, dtype=dtype)
        self.mlp = MLP(n_embd, dropout, rng, dtype) if moe is None else MoE(
            n_embd, moe.experts, moe.top_k, moe.capacity_factor, moe.aux_loss_coef, rng=rng,
            dtype=dtype)
        #: keep only the block's input and recompute the rest in backward; a mixture of experts
        #: keeps what it saves (the attention sublayer alone is recomputed: docs/moe.md)
        self.recompute = False


class GPT(nn.Module):
    """A decoder-only transformer mapping token ids (B, T) to next-token logits (B, T, vocab).

    ``dropout`` applies to the embedding sum and to the output of each residual branch (but a
    mixture of experts'). ``moe`` puts mixture-of-experts layers in place of the MLPs of the
    blocks it names (``blocks.0.mlp.router.weight``, ``blocks.0.mlp.experts.3.fc.weight``, ...).
    """

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                 dropout: float = 0.0, *, rng: np.random.Generator | None = None,
                 seed: int | None = None, dtype: Any = np.float32,
                 moe: MoESettings | None = None) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size),
                            ("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPT: {name} must be a positive int, not {value!r}")
        if n_embd % n_head:
            raise ValueError(f"GPT: n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"GPT: dropout must lie in [0, 1), not {dropout!r}")
        g = nn.make_rng(rng, seed)
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.token_embedding = nn.Embedding(vocab_size, n_embd, rng=g, dtype=dtype)
        self.position_embedding = nn.Embedding(block_size, n_embd, rng=g, dtype=dtype)
        self.dropout = nn.Dropout(dropout, rng=g)
        self.blocks = nn.ModuleList(
            Block(n_embd, n_head, dropout, g, dtype, moe if moe and moe.in_block(i) else None)
            for i in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, dtype=dtype)
        self._init_weights(g)

    def _init_weights(self, g: np.random.Generator) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.data[...] = 0
            elif name.endswith("weight") and ".ln" not in name and not name.startswith("ln_f"):
                std = residual_std if name.endswith("proj.weight") else 0.02
                p.data[...] = g.normal(0.0, std, p.shape).astype(p.dtype)

    def forward(self, idx: Any) -> Tensor:
        """Logits (B, T, vocab_size) for token ids ``idx`` (B, T), T ≤ block_size."""
        data = idx.data if isinstance(idx, Tensor) else idx
        xp = get_array_module(self.token_embedding.weight.data)
        data = xp.asarray(data)
        if data.ndim != 2:
            raise ValueError(f"GPT: idx must be (batch, time) token ids, got shape "
                             f"{tuple(data.shape)}")
        t = data.shape[1]
        if not 1 <= t <= self.block_size:
            raise ValueError(f"GPT: sequence length {t} must lie in [1, block_size="
                             f"{self.block_size}]")
        x = self.token_embedding(data) + self.position_embedding(xp.arange(t))
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.token_embedding.weight)

    def set_recompute(self, mode: str) -> None:
        """Recompute in backward nothing ("none"), each block's attention core ("selective") or
        each whole block ("full")."""
        if mode not in RECOMPUTE:
            raise ValueError(f"recompute: expected one of {', '.join(RECOMPUTE)}, got {mode!r}")
        for block in self.blocks:
            block.recompute = mode == "full"
            block.attn.recompute_core = mode == "selective"

    def generate(self, idx: Any, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, rng: np.random.Generator | None = None) -> np.ndarray:
        """``idx`` (B, T) followed by ``max_new_tokens`` sampled tokens, as a host int64 array.

        Each step feeds the last ``block_size`` tokens, divides the last logits by
        ``temperature`` and samples among the ``top_k`` most likely tokens (``top_k=1`` is greedy
        decoding). Runs in evaluation mode without recording a graph.
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be a non-negative int, not "
                             f"{max_new_tokens!r}")
        if not temperature > 0:
            raise ValueError(f"generate: temperature must be > 0, not {temperature!r}")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"generate: top_k must be a positive int or None, not {top_k!r}")
        out = np.array(to_host(idx.data if isinstance(idx, Tensor) else idx), dtype=np.int64)
        if out.ndim != 2:
            raise ValueError(f"generate: idx must be (batch, time), got shape {out.shape}")
        rng = rng if rng is not None else np.random.default_rng()
        was_training = self.training
        self.eval()
        try:
            with no_grad():
                for _ in range(max_new_tokens):
                    logits = self(out[:, -self.block_size:])
                    last = np.asarray(to_host(logits.data[:, -1, :]), dtype=np.float64)
                    out = np.concatenate([out, _sample(last, temperature, top_k, rng)], axis=1)
        finally:
            self.train(was_training)
        return out

    def num_parameters(self, non_embedding: bool = False) -> int:
        """The number of trainable values (each shared array once); ``non_embedding`` leaves
        out the position embedding (the token embedding doubles as the output projection)."""
        n = sum(p.size for p in self.parameters())
        return n - self.position_embedding.weight.size if non_embedding else n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token at sequence length ``seq_len``
        (default block_size): 6·N + 12·n_layer·n_embd·seq_len, with N = ``num_parameters(
        non_embedding=True)`` (the tied token embedding counts: it is also the output
        projection; of a mixture of experts, the router and the k experts a token uses). This is
        the PaLM paper's formula (appendix B), the one llm.c and nanoGPT use for model FLOPs
        utilisation."""
        t = self.block_size if seq_len is None else seq_len
        active = self.num_parameters(non_embedding=True) - sum(
            b.mlp.inactive_parameters() for b in self.blocks if isinstance(b.mlp, MoE))
        return 6 * active + 12 * self.n_layer * self.n_embd * t

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, block_size={self.block_size}, "
                f"n_layer={self.n_layer}, n_head={self.n_head}, n_embd={self.n_embd}")


def _sample(logits: np.ndarray, temperature: float, top_k: int | None,
            rng: np.random.Generator) -> np.ndarray:
    """One token per row of (B, V) ``logits``, as a (B, 1) int64 array."""
    if top_k == 1:
        return logits.argmax(axis=-1)[:, None]
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = np.partition(logits, -top_k, axis=-1)[:, -top_k][:, None]
        logits = np.where(logits < kth, -np.inf, logits)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    u = rng.random((len(p), 1))
    return np.minimum((p.cumsum(axis=-1) < u).sum(axis=-1), p.shape[-1] - 1)[:, None]
