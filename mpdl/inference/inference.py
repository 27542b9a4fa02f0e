"""The GPT's forward over a KV cache, on plain arrays: prefill the prompt once, then one token a step.

A `Decoder` takes the weights of a `GPT` as plain arrays (NumPy or CuPy, no autograd graph) and
runs the same arithmetic as `GPT.forward` (LayerNorm, the fused qkv projection, softmax attention,
the exact-erf GELU, the tied output projection) in the same order, so that its logits agree with
the uncached forward to rounding (within 1e-5 in float32) and greedy decoding gives the same
tokens.

**The cache.** `KVCache` holds, per layer, the keys and values of every position of every
sequence of a batch: two (layers, batch, heads, block_size, head_dim) arrays, allocated once for
the batch up to the block size. `prefill` runs a batch of windows of tokens (positions 0..T-1),
writes their keys and values into the cache and returns the hidden states; `step` runs one new
token per sequence, each at its own position, writes its key and value there and attends to the
sequence's cached positions only.

**Prompts of different lengths** are right-padded: row b holds its n_b tokens at positions
0..n_b-1 and padding after them. Causal attention keeps the padding out of the real positions
during the prefill; in each step row b's token sits at position n_b and a mask hides the cache
beyond it, so the keys and values the padding left there are never read before the row's own
tokens overwrite them. Every row keeps its own position, so its tokens are those it would get
alone.

**Tensor parallelism** (Megatron-LM, as `mpdl.parallel.tensor_parallel` trains it): given `tp_comm`, a
decoder keeps its rank's heads of the qkv projection and of attention's output projection (input
columns), and its slice of the MLP's hidden units; each block sums the partial outputs of
attention and of the MLP with two all-reduces over `tp_comm`. A decode step sends B·C values per
all-reduce: latency-bound, so each shape gets a persistent plan (`allreduce_init`, the
small-message path) made on first use and reused for every token. **A pipeline stage** keeps the
blocks `layers` of its stage, the embeddings when it is the first, the final LayerNorm and the
tied projection when it is the last. Building a tensor-parallel decoder is collective over the
world (`auto`'s first use on its tp communicator): every rank builds its decoder at the same point.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from mpdl.autograd import kernels
from mpdl.backend import get_array_module
from mpdl.comm import Communicator
from mpdl.tuning import Plan, allreduce_init, auto

_INV_SQRT_2 = 1.0 / math.sqrt(2.0)


class LayerWeights(NamedTuple):
    """One block's weights on this rank (the qkv, fc rows and proj columns of its tp shard)."""

    ln1_w: Any
    ln1_b: Any
    qkv_w: Any
    qkv_b: Any
    attn_proj_w: Any
    attn_proj_b: Any
    ln2_w: Any
    ln2_b: Any
    fc_w: Any
    fc_b: Any
    mlp_proj_w: Any
    mlp_proj_b: Any


class KVCache:
    """Keys and values of `layers` blocks for `batch` sequences up to `block_size` positions:
    `k[l, b, h, s]` is the key of head h at position s of sequence b in the l-th block."""

    def __init__(self, layers: int, batch: int, heads: int, block_size: int, head_dim: int,
                 dtype: Any, xp: Any = np) -> None:
        shape = (layers, batch, heads, block_size, head_dim)
        self.k = xp.zeros(shape, dtype=dtype)
        self.v = xp.zeros(shape, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


def _layer_norm(x: Any, w: Any, b: Any, eps: float = 1e-5) -> Any:
    xp = get_array_module(x)
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    var = (xc * xc).mean(axis=-1, keepdims=True)
    xc *= 1.0 / xp.sqrt(var + eps)
    return xc * w + b


def _linear(x: Any, w: Any, b: Any = None, out: Any = None) -> Any:
    """x @ wᵀ (+ b) over x's leading axes, as one GEMM (into `out` when given)."""
    flat = x.reshape(-1, x.shape[-1])
    if out is None:
        y = flat @ w.T
    else:
        y = get_array_module(x).matmul(flat, w.T, out=out.reshape(flat.shape[0], w.shape[0]))
    if b is not None:
        y += b
    return y.reshape(*x.shape[:-1], w.shape[0])


def _gelu(x: Any) -> Any:
    return x * (0.5 * (1 + kernels.erf(x * _INV_SQRT_2)))


def _softmax_(att: Any) -> Any:
    get_array_module(att).exp(att - att.max(axis=-1, keepdims=True), out=att)
    att /= att.sum(axis=-1, keepdims=True)
    return att


class Decoder:
    """The GPT's forward over a KV cache for the blocks `layers` (default: all), on this tp
    rank's heads and hidden units when `tp_comm` is given; `embed` / `head`: whether this
    decoder holds the embeddings / the final LayerNorm and tied output projection."""

    def __init__(self, gpt: Any, layers: range | None = None, tp_comm: Communicator | None = None,
                 algorithm: str = "auto", embed: bool = True, head: bool = True) -> None:
        tp = 1 if tp_comm is None else tp_comm.size
        t = 0 if tp_comm is None else tp_comm.rank
        if gpt.n_head % tp:
            raise ValueError(f"tp: {tp} tensor-parallel ranks must divide the {gpt.n_head} heads")
        self.block_size, self.n_embd = gpt.block_size, gpt.n_embd
        self.heads = gpt.n_head // tp
        self.head_dim = gpt.n_embd // gpt.n_head
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.tp_comm, self.algorithm = (tp_comm if tp > 1 else None), algorithm
        if self.tp_comm is not None and algorithm == "auto":
            auto.model_for(self.tp_comm)  # collective the first time (over the world): now
        self.dtype = gpt.token_embedding.weight.data.dtype
        self.xp = get_array_module(gpt.token_embedding.weight.data)
        self.layers = [self._shard(gpt.blocks[i], t, tp)
                       for i in (range(gpt.n_layer) if layers is None else layers)]
        if embed or head:
            self.wte = gpt.token_embedding.weight.data
        if embed:
            self.wpe = gpt.position_embedding.weight.data
        if head:
            self.ln_f = (gpt.ln_f.weight.data, gpt.ln_f.bias.data)
        self._plans: dict[tuple[int, ...], Plan] = {}
        _gelu(self.xp.zeros(1, dtype=self.dtype))  # compile the erf kernel before any timing

    def _shard(self, block: Any, t: int, tp: int) -> LayerWeights:
        xp, c = self.xp, self.n_embd
        width = self.heads * self.head_dim
        cols = slice(t * width, (t + 1) * width)
        qkv_rows = xp.concatenate([xp.arange(part * c + t * width, part * c + (t + 1) * width)
                                   for part in range(3)])
        hidden = block.mlp.fc.weight.shape[0] // tp
        fc_rows = slice(t * hidden, (t + 1) * hidden)

        def own(a: Any) -> Any:
            return xp.ascontiguousarray(a)

        a, m = block.attn, block.mlp
        return LayerWeights(
            block.ln1.weight.data, block.ln1.bias.data,
            own(a.qkv.weight.data[qkv_rows]), own(a.qkv.bias.data[qkv_rows]),
            own(a.proj.weight.data[:, cols]), a.proj.bias.data,
            block.ln2.weight.data, block.ln2.bias.data,
            own(m.fc.weight.data[fc_rows]), own(m.fc.bias.data[fc_rows]),
            own(m.proj.weight.data[:, fc_rows]), m.proj.bias.data)

    def new_cache(self, batch: int) -> KVCache:
        """An empty cache for `batch` sequences of this decoder's blocks."""
        return KVCache(len(self.layers), batch, self.heads, self.block_size, self.head_dim,
                       self.dtype, self.xp)

    # -- the pieces ---------------------------------------------------------------------------
    def embed(self, tokens: Any, positions: Any = None) -> Any:
        """Token + position embedding of token ids (B, T): at positions 0..T-1, or, for a step
        (T = 1), at `positions` (B,)."""
        xp = self.xp
        tokens = xp.asarray(tokens)
        if positions is None:
            return self.wte[tokens] + self.wpe[xp.arange(tokens.shape[1])]
        return self.wte[tokens] + self.wpe[xp.asarray(positions)][:, None, :]

    def prefill(self, x: Any, cache: KVCache) -> Any:
        """The blocks over hidden states x (B, T, C) at positions 0..T-1 of every sequence,
        their keys and values written into positions 0..T-1 of `cache`."""
        xp = self.xp
        t = x.shape[1]
        mask = xp.triu(xp.full((t, t), -xp.inf, dtype=x.dtype), 1)

        def attend(layer: int, q: Any, k: Any, v: Any) -> Any:
            cache.k[layer, :, :, :t] = k
            cache.v[layer, :, :, :t] = v
            att = q @ xp.swapaxes(k, -1, -2)
            att *= self.scale
            att += mask
            return _softmax_(att) @ v

        return self._blocks(x, attend)

    def step(self, x: Any, positions: Any, cache: KVCache) -> Any:
        """The blocks over one new token per sequence, x (B, 1, C), sequence b's at position
        positions[b] (< block_size): its key and value go there, and it attends to positions
        0..positions[b] of the cache."""
        xp = self.xp
        pos = xp.asarray(positions)
        rows = xp.arange(x.shape[0])
        s = int(pos.max()) + 1
        mask = xp.where(xp.arange(s)[None, :] > pos[:, None], -xp.inf, 0).astype(x.dtype)
        mask = mask[:, None, None, :]

        def attend(layer: int, q: Any, k: Any, v: Any) -> Any:
            cache.k[layer, rows, :, pos] = k[:, :, 0]
            cache.v[layer, rows, :, pos] = v[:, :, 0]
            att = q @ xp.swapaxes(cache.k[layer, :, :, :s], -1, -2)
            att *= self.scale
            att += mask
            return _softmax_(att) @ cache.v[layer, :, :, :s]

        return self._blocks(x, attend)

    def logits(self, x: Any) -> Any:
        """Next-token logits (B, vocab) of the hidden states x (B, C)."""
        return _linear(_layer_norm(x, *self.ln_f), self.wte)

    # -- a block --------------------------------------------------------------------------------
    def _blocks(self, x: Any, attend: Any) -> Any:
        b, t, c = x.shape
        h, hd = self.heads, self.head_dim
        for i, w in enumerate(self.layers):
            qkv = _linear(_layer_norm(x, w.ln1_w, w.ln1_b), w.qkv_w, w.qkv_b)
            qkv = qkv.reshape(b, t, 3, h, hd).transpose(2, 0, 3, 1, 4)
            y = attend(i, qkv[0], qkv[1], qkv[2]).transpose(0, 2, 1, 3).reshape(b, t, h * hd)
            x = x + self._row_parallel(y, w.attn_proj_w, w.attn_proj_b)
            hidden = _gelu(_linear(_layer_norm(x, w.ln2_w, w.ln2_b), w.fc_w, w.fc_b))
            x = x + self._row_parallel(hidden, w.mlp_proj_w, w.mlp_proj_b)
        return x

    def _row_parallel(self, x: Any, w: Any, b: Any) -> Any:
        """x @ wᵀ summed over the tp ranks (each holds its columns of w), then + b."""
        if self.tp_comm is None:
            return _linear(x, w, b)
        shape = (*x.shape[:-1], w.shape[0])
        plan = self._plans.get(shape)
        if plan is None:
            buf = self.xp.empty(shape, dtype=self.dtype)
            plan = self._plans[shape] = allreduce_init(buf, algorithm=self.algorithm,
                                                       comm=self.tp_comm, out=buf)
        _linear(x, w, out=plan.x)
        y = plan()
        return y + b
