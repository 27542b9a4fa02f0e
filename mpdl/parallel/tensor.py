"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) for the GPT, over the tp axis of a grid.

In each block, attention's fused qkv projection is split column-wise by heads (tp rank t computes
heads [t·H/T, (t+1)·H/T) of q, k and v) and its output projection row-wise (the matching input
columns); the MLP's first Linear is split column-wise (a slice of the 4·C hidden units, GELU
applied locally) and its second row-wise. Each column-then-row pair needs two operators:

    f: identity forward, all-reduce of the gradient backward    (before the column-parallel layer)
    g: all-reduce forward, identity backward                    (after the row-parallel layer)

so a block all-reduces twice forward (g after attention, g after the MLP) and twice backward (f
before each), over `tp_comm` with mpdl's all-reduce. The row-parallel layers' biases are added
once, after g. Embeddings, LayerNorms and the tied output projection are **replicated** on every
tp rank (the documented alternative to a vocabulary-parallel embedding and cross-entropy): their
inputs and output gradients are the same on every tp rank, so their gradients are too, and they
need no communication.

`TensorParallelGPT` wraps a GPT: the replicated parts are the GPT's own parameters, the shards new
parameters holding slices of the GPT's. `gather_into_model()` all-gathers the shards back into
the GPT's parameters (evaluation and checkpoints use the whole model), `scatter_from_model()`
takes the shards from them again (after a checkpoint was loaded into the GPT).
"""

from __future__ import annotations

from typing import Any

import mpdl.autograd.functional as F
from mpdl.autograd import nn
from mpdl.autograd.recompute import checkpoint
from mpdl.autograd.tensor import Function, Tensor
from mpdl.backend import get_array_module
from mpdl.collectives import allgather, allreduce
from mpdl.comm import Communicator


class CopyToTP(Function):
    """f: identity forward; backward, the sum of the gradient over the tp ranks."""

    def forward(self, x: Any, comm: Communicator = None, algorithm: str = "auto") -> Any:
        self.comm, self.algorithm = comm, algorithm
        return x

    def backward(self, grad: Any) -> Any:
        return allreduce(grad, op="sum", algorithm=self.algorithm, comm=self.comm)


class ReduceFromTP(Function):
    """g: forward, the sum of the partial outputs over the tp ranks; identity backward."""

    def forward(self, x: Any, comm: Communicator = None, algorithm: str = "auto") -> Any:
        return allreduce(x, op="sum", algorithm=algorithm, comm=comm)

    def backward(self, grad: Any) -> Any:
        return grad


def _shard(data: Any, index: Any) -> nn.Parameter:
    """This rank's slice of a whole parameter, in a buffer of its own (a view of a row slice
    would keep the whole tensor alive after the pipeline releases it)."""
    xp = get_array_module(data)
    return nn.Parameter(xp.array(data[index], copy=True, order="C"))


def _causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class TPAttention(nn.Module):
    """Causal self-attention on this tp rank's heads (column-parallel qkv, row-parallel proj)."""

    def __init__(self, attn: Any, comm: Communicator, algorithm: str) -> None:
        super().__init__()
        self.comm, self.algorithm = comm, algorithm
        c = attn.proj.weight.shape[0]
        self.heads = attn.n_head // comm.size
        width = self.heads * (c // attn.n_head)  # this rank's columns of q, k and v each

        def rows(t: int) -> list[int]:  # of the fused qkv: rank t's part of q, of k, of v
            return [part * c + i for part in range(3) for i in range(t * width, (t + 1) * width)]

        def cols(t: int) -> tuple[slice, slice]:
            return slice(None), slice(t * width, (t + 1) * width)

        self.qkv_weight = _shard(attn.qkv.weight.data, rows(comm.rank))
        self.qkv_bias = _shard(attn.qkv.bias.data, rows(comm.rank))
        self.proj_weight = _shard(attn.proj.weight.data, cols(comm.rank))
        self.proj_bias = attn.proj.bias  # replicated, added after the all-reduce
        self.dropout = attn.dropout
        self.recompute_core = getattr(attn, "recompute_core", False)
        self.__dict__["shards"] = [(self.qkv_weight, attn.qkv.weight, rows),
                                   (self.qkv_bias, attn.qkv.bias, rows),
                                   (self.proj_weight, attn.proj.weight, cols)]

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        h = self.heads
        x = CopyToTP.apply(x, comm=self.comm, algorithm=self.algorithm)
        local = self.qkv_weight.shape[0] // 3
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias).reshape(b, t, 3, h, local // h)
        qkv = qkv.transpose(2, 0, 3, 1, 4)
        if self.recompute_core:
            y = checkpoint(_causal_attention, qkv[0], qkv[1], qkv[2])
        else:
            y = _causal_attention(qkv[0], qkv[1], qkv[2])
        y = F.linear(y.transpose(0, 2, 1, 3).reshape(b, t, local), self.proj_weight)
        y = ReduceFromTP.apply(y, comm=self.comm, algorithm=self.algorithm)
        return self.dropout(y + self.proj_bias)


class TPMLP(nn.Module):
    """The MLP on this tp rank's hidden units (column-parallel fc, row-parallel proj)."""

    def __init__(self, mlp: Any, comm: Communicator, algorithm: str) -> None:
        super().__init__()
        self.comm, self.algorithm = comm, algorithm
        part = mlp.fc.weight.shape[0] // comm.size

        def rows(t: int) -> slice:
            return slice(t * part, (t + 1) * part)

        def cols(t: int) -> tuple[slice, slice]:
            return slice(None), rows(t)

        self.fc_weight = _shard(mlp.fc.weight.data, rows(comm.rank))
        self.fc_bias = _shard(mlp.fc.bias.data, rows(comm.rank))
        self.proj_weight = _shard(mlp.proj.weight.data, cols(comm.rank))
        self.proj_bias = mlp.proj.bias
        self.dropout = mlp.dropout
        self.__dict__["shards"] = [(self.fc_weight, mlp.fc.weight, rows),
                                   (self.fc_bias, mlp.fc.bias, rows),
                                   (self.proj_weight, mlp.proj.weight, cols)]

    def forward(self, x: Tensor) -> Tensor:
        x = CopyToTP.apply(x, comm=self.comm, algorithm=self.algorithm)
        y = F.linear(F.gelu(F.linear(x, self.fc_weight, self.fc_bias)), self.proj_weight)
        y = ReduceFromTP.apply(y, comm=self.comm, algorithm=self.algorithm)
        return self.dropout(y + self.proj_bias)


class TPBlock(nn.Module):
    """A transformer block with tensor-parallel attention and MLP, replicated LayerNorms."""

    def __init__(self, block: Any, comm: Communicator, algorithm: str) -> None:
        super().__init__()
        self.ln1, self.ln2 = block.ln1, block.ln2
        self.attn = TPAttention(block.attn, comm, algorithm)
        self.mlp = TPMLP(block.mlp, comm, algorithm)
        self.recompute = getattr(block, "recompute", False)

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(self.residual, x) if self.recompute else self.residual(x)

    def residual(self, x: Tensor) -> Tensor:
        """The block without recomputation."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TensorParallelGPT(nn.Module):
    """A GPT whose blocks are split over `comm` (the tp axis); the rest is the GPT's own,
    replicated. Has the GPT's attribute names, so a pipeline cuts it like a GPT."""

    def __init__(self, gpt: Any, comm: Communicator, algorithm: str = "auto") -> None:
        super().__init__()
        if gpt.n_head % comm.size:
            raise ValueError(f"tp: {comm.size} tensor-parallel ranks must divide the "
                             f"{gpt.n_head} heads")
        self.token_embedding, self.position_embedding = gpt.token_embedding, gpt.position_embedding
        self.dropout, self.ln_f = gpt.dropout, gpt.ln_f
        self.blocks = nn.ModuleList(TPBlock(b, comm, algorithm) for b in gpt.blocks)
        self.comm = comm
        self.__dict__["gpt"] = gpt  # not a submodule: its sharded weights are not trained here

    def forward(self, idx: Any) -> Tensor:
        xp = get_array_module(self.token_embedding.weight.data)
        data = xp.asarray(idx.data if isinstance(idx, Tensor) else idx)
        x = self.dropout(self.token_embedding(data) + self.position_embedding(
            xp.arange(data.shape[1])))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.token_embedding.weight)

    @property
    def shards(self) -> list[tuple[Any, Any, Any]]:
        """(shard, the GPT's whole parameter, index(t): where rank t's shard sits in it)."""
        return [entry for b in self.blocks for m in (b.attn, b.mlp) for entry in m.shards]

    def gather_into_model(self) -> None:
        """All-gather every shard into the wrapped GPT's parameters (collective over tp)."""
        for shard, full, index in self.shards:
            full.data = gather_array(shard.data, full.shape, index, self.comm)

    def scatter_from_model(self) -> None:
        """Copy this rank's slices of the wrapped GPT's parameters into the shards (no messages;
        after the GPT's parameters were loaded)."""
        for shard, full, index in self.shards:
            shard.data[...] = full.data[index(self.comm.rank)]


def gather_array(shard: Any, shape: tuple[int, ...], index: Any, comm: Communicator) -> Any:
    """The whole array of `shape` whose slice index(t) rank t holds as `shard` (collective)."""
    xp = get_array_module(shard)
    everyone = allgather(xp.ascontiguousarray(shard), comm=comm).reshape(comm.size, *shard.shape)
    whole = xp.empty(shape, dtype=shard.dtype)
    for t in range(comm.size):
        whole[index(t)] = everyone[t]
    return whole
