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
the GPT's parameters (evaluation and checkpoints use the whole model).
"""

from __future__ import annotations

from typing import Any

import mpdl.autograd.functional as F
from mpdl.autograd import nn
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
    xp = get_array_module(data)
    return nn.Parameter(xp.ascontiguousarray(data[index]))


class TPAttention(nn.Module):
    """Causal self-attention on this tp rank's heads (column-parallel qkv, row-parallel proj)."""

    def __init__(self, attn: Any, comm: Communicator, algorithm: str) -> None:
        super().__init__()
        self.comm, self.algorithm = comm, algorithm
        tp, t = comm.size, comm.rank
        c = attn.proj.weight.shape[0]
        self.heads = attn.n_head // tp
        hd = c // attn.n_head
        self.cols = slice(t * self.heads * hd, (t + 1) * self.heads * hd)  # of q, k and v each
        rows = [r for part in range(3)
                for r in range(part * c + self.cols.start, part * c + self.cols.stop)]
        self.qkv_weight = _shard(attn.qkv.weight.data, rows)
        self.qkv_bias = _shard(attn.qkv.bias.data, rows)
        self.proj_weight = _shard(attn.proj.weight.data, (slice(None), self.cols))
        self.proj_bias = attn.proj.bias  # replicated, added after the all-reduce
        self.dropout = attn.dropout
        self.full = attn

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        h = self.heads
        x = CopyToTP.apply(x, comm=self.comm, algorithm=self.algorithm)
        local = self.qkv_weight.shape[0] // 3
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias).reshape(b, t, 3, h, local // h)
        qkv = qkv.transpose(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        y = F.linear(y.transpose(0, 2, 1, 3).reshape(b, t, local), self.proj_weight)
        y = ReduceFromTP.apply(y, comm=self.comm, algorithm=self.algorithm)
        return self.dropout(y + self.proj_bias)

    def gather(self) -> None:
        full = self.full
        _gather_rows(full.qkv.weight, self.qkv_weight, self.comm, parts=3)
        _gather_rows(full.qkv.bias, self.qkv_bias, self.comm, parts=3)
        _gather_cols(full.proj.weight, self.proj_weight, self.comm)


class TPMLP(nn.Module):
    """The MLP on this tp rank's hidden units (column-parallel fc, row-parallel proj)."""

    def __init__(self, mlp: Any, comm: Communicator, algorithm: str) -> None:
        super().__init__()
        self.comm, self.algorithm = comm, algorithm
        hidden = mlp.fc.weight.shape[0]
        part = hidden // comm.size
        cols = slice(comm.rank * part, (comm.rank + 1) * part)
        self.fc_weight = _shard(mlp.fc.weight.data, cols)
        self.fc_bias = _shard(mlp.fc.bias.data, cols)
        self.proj_weight = _shard(mlp.proj.weight.data, (slice(None), cols))
        self.proj_bias = mlp.proj.bias
        self.dropout = mlp.dropout
        self.full = mlp

    def forward(self, x: Tensor) -> Tensor:
        x = CopyToTP.apply(x, comm=self.comm, algorithm=self.algorithm)
        y = F.linear(F.gelu(F.linear(x, self.fc_weight, self.fc_bias)), self.proj_weight)
        y = ReduceFromTP.apply(y, comm=self.comm, algorithm=self.algorithm)
        return self.dropout(y + self.proj_bias)

    def gather(self) -> None:
        full = self.full
        _gather_rows(full.fc.weight, self.fc_weight, self.comm, parts=1)
        _gather_rows(full.fc.bias, self.fc_bias, self.comm, parts=1)
        _gather_cols(full.proj.weight, self.proj_weight, self.comm)


class TPBlock(nn.Module):
    """A transformer block with tensor-parallel attention and MLP, replicated LayerNorms."""

    def __init__(self, block: Any, comm: Communicator, algorithm: str) -> None:
        super().__init__()
        self.ln1, self.ln2 = block.ln1, block.ln2
        self.attn = TPAttention(block.attn, comm, algorithm)
        self.mlp = TPMLP(block.mlp, comm, algorithm)

    def forward(self, x: Tensor) -> Tensor:
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
        self.__dict__["gpt"] = gpt  # not a submodule: its sharded weights are not trained here

    def forward(self, idx: Any) -> Tensor:
        xp = get_array_module(self.token_embedding.weight.data)
        data = xp.asarray(idx.data if isinstance(idx, Tensor) else idx)
        x = self.dropout(self.token_embedding(data) + self.position_embedding(
            xp.arange(data.shape[1])))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.token_embedding.weight)

    def gather_into_model(self) -> None:
        """All-gather every shard into the wrapped GPT's parameters (collective over tp)."""
        for block in self.blocks:
            block.attn.gather()
            block.mlp.gather()


def _gather_rows(full: Any, shard: Any, comm: Communicator, parts: int) -> None:
    """full's rows from every rank's shard: the shard holds, for each of `parts` equal parts of
    full's rows, rank t's t-th slice of that part."""
    xp = get_array_module(shard.data)
    everyone = allgather(xp.ascontiguousarray(shard.data), comm=comm).reshape(
        comm.size, parts, -1, *shard.shape[1:])
    full.data[...] = xp.concatenate([everyone[:, k].reshape(-1, *shard.shape[1:])
                                     for k in range(parts)]).reshape(full.shape)


def _gather_cols(full: Any, shard: Any, comm: Communicator) -> None:
    xp = get_array_module(shard.data)
    everyone = allgather(xp.ascontiguousarray(shard.data), comm=comm).reshape(
        comm.size, *shard.shape)
    full.data[...] = xp.concatenate(list(everyone), axis=1)
