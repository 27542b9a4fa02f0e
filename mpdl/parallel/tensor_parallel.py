"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) for the GPT, over the tp axis of a grid.

In each block, attention's fused qkv projection is split column-wise by heads (tp rank t computes
heads [t·H/T, (t+1)·H/T) of q, k and v) and its output projection row-wise (the matching input
columns); the MLP's first Linear is split column-wise (a slice of the 4·C hidden units, GELU
applied locally) and its second row-wise. Each column-then-row pair needs two operators:

    f: identity forward, all-reduce of the gradient backward    (before the column-parallel layer)
    g: all-reduce forward, identity backward                    (after the row-parallel layer)

so a block all-reduces twice forward (g after attention, g after the MLP) and twice backward (f
before each), over `tp_comm` with mpdl's all-reduce. The row-parallel layers' biases are added
once, after g. Embeddings, LayerNorms, mixtures of experts (`mpdl.models.moe.MoE`: router and
experts) and the tied output projection are **replicated** on every tp rank (the documented
alternative to a vocabulary-parallel embedding and cross-entropy): their inputs and output
gradients are the same on every tp rank, so their gradients are too, and they need no
communication.

**Sequence parallelism** (Megatron-LM, Korthikanti et al. 2022; `sequence_parallel=True`): the
LayerNorms, the row-parallel biases and the dropouts run on this tp rank's contiguous slice of
the sequence instead of the whole replicated activation, and the conjugate pair becomes

    f: all-gather along the sequence forward, reduce-scatter of the gradient backward
    g: reduce-scatter along the sequence forward, all-gather of the gradient backward

which move the same bytes as the all-reduces they replace (an all-reduce is a reduce-scatter
then an all-gather) while each rank keeps 1/T of those activations. The embedding's output is
split (backward: all-gather), the final LayerNorm's output gathered (backward: this rank's
slice; the loss is computed whole on every tp rank). The parameters of the sliced regions see
only 1/T of the positions: `sequence_parallel_params()` lists them, and their gradients are
summed over tp after backward.

`TensorParallelGPT` wraps a GPT: the replicated parts are the GPT's own parameters, the shards new
parameters holding slices of the GPT's. `gather_into_model()` all-gathers the shards back into
the GPT's parameters (evaluation and checkpoints use the whole model), `scatter_from_model()`
takes the shards from them again (after a checkpoint was loaded into the GPT).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import mpdl.autograd.functional as F
from mpdl.autograd import amp, nn
from mpdl.autograd.recompute import checkpoint
from mpdl.autograd.tensor import Function, Tensor
from mpdl.backend import get_array_module
from mpdl.collectives import allgather, allreduce, reduce_scatter
from mpdl.comm import Communicator
from mpdl.models.block import ResidualBlock
from mpdl.models.moe import MoE


def in_dtype(collective: Any, x: Any, dtype: Any) -> Any:
    """collective(x) run on x rounded to `dtype` (mixed precision's 16-bit compute dtype: the
    messages are 16-bit, mpdl's reductions add in float32 inside), the result in x's dtype again;
    collective(x) itself for dtype None."""
    if dtype is None:
        return collective(x)
    with np.errstate(over="ignore"):  # float16 overflow is inf, for the loss scaler to see
        narrow = x.astype(dtype)
    return collective(narrow).astype(x.dtype)


class CopyToTP(Function):
    """f: identity forward; backward, the sum of the gradient over the tp ranks (in `dtype`
    when it is given: mixed precision's compute dtype)."""

    def forward(self, x: Any, comm: Communicator = None, algorithm: str = "auto",
                dtype: Any = None) -> Any:
        self.comm, self.algorithm, self.dtype = comm, algorithm, dtype
        return x

    def backward(self, grad: Any) -> Any:
        if self.comm.size == 1:
            return grad
        return in_dtype(lambda g: allreduce(g, op="sum", algorithm=self.algorithm,
                                            comm=self.comm), grad, self.dtype)


class ReduceFromTP(Function):
    """g: forward, the sum of the partial outputs over the tp ranks (in `dtype` when it is
    given); identity backward."""

    def forward(self, x: Any, comm: Communicator = None, algorithm: str = "auto",
                dtype: Any = None) -> Any:
        if comm.size == 1:
            return x
        return in_dtype(lambda a: allreduce(a, op="sum", algorithm=algorithm, comm=comm), x,
                        dtype)

    def backward(self, grad: Any) -> Any:
        return grad


def _to_blocks(x: Any, p: int) -> Any:
    """(B, T, ...) as (p, B, T/p, ...): rank t's contiguous slice of the sequence as block t."""
    xp = get_array_module(x)
    b, t = x.shape[:2]
    return xp.ascontiguousarray(xp.moveaxis(x.reshape(b, p, t // p, *x.shape[2:]), 1, 0))


def _from_blocks(blocks: Any) -> Any:
    """(p, B, T/p, ...) blocks as the (B, T, ...) sequence."""
    xp = get_array_module(blocks)
    p, b, t = blocks.shape[:3]
    return xp.moveaxis(blocks, 0, 1).reshape(b, p * t, *blocks.shape[3:])


def gather_sequence(x: Any, comm: Communicator, algorithm: str = "auto",
                    dtype: Any = None) -> Any:
    """Every tp rank's (B, T/p, ...) slice joined into the (B, T, ...) sequence (sent in
    `dtype` when it is given)."""
    whole = in_dtype(lambda a: allgather(a, algorithm=algorithm, comm=comm), x, dtype)
    return _from_blocks(whole.reshape(comm.size, *x.shape))


def reduce_scatter_sequence(x: Any, comm: Communicator, algorithm: str = "auto",
                            dtype: Any = None) -> Any:
    """This rank's (B, T/p, ...) slice of the sum of (B, T, ...) x over the tp ranks (summed
    in `dtype` when it is given)."""
    b, t = x.shape[:2]
    mine = in_dtype(lambda a: reduce_scatter(a, op="sum", algorithm=algorithm, comm=comm),
                    _to_blocks(x, comm.size), dtype)
    return mine.reshape(b, t // comm.size, *x.shape[2:])


def sequence_slice(x: Any, comm: Communicator) -> Any:
    """This rank's contiguous (B, T/p, ...) slice of a (B, T, ...) array."""
    part = x.shape[1] // comm.size
    return x[:, comm.rank * part:(comm.rank + 1) * part]


class GatherSequence(Function):
    """Sequence parallelism's f: all-gather along the sequence; backward, reduce-scatter."""

    def forward(self, x: Any, comm: Communicator = None, algorithm: str = "auto",
                dtype: Any = None) -> Any:
        self.comm, self.algorithm, self.dtype = comm, algorithm, dtype
        return gather_sequence(x, comm, algorithm, dtype)

    def backward(self, grad: Any) -> Any:
        return reduce_scatter_sequence(grad, self.comm, self.algorithm, self.dtype)


class ReduceScatterSequence(Function):
    """Sequence parallelism's g: reduce-scatter along the sequence; backward, all-gather."""

    def forward(self, x: Any, comm: Communicator = None, algorithm: str = "auto",
                dtype: Any = None) -> Any:
        self.comm, self.algorithm, self.dtype = comm, algorithm, dtype
        return reduce_scatter_sequence(x, comm, algorithm, dtype)

    def backward(self, grad: Any) -> Any:
        return gather_sequence(grad, self.comm, self.algorithm, self.dtype)


class SplitSequence(Function):
    """Into the sequence-parallel region: this rank's slice of a replicated activation;
    backward, the all-gather of every rank's slice of the gradient."""

    def forward(self, x: Any, comm: Communicator = None, algorithm: str = "auto",
                dtype: Any = None) -> Any:
        self.comm, self.algorithm, self.dtype = comm, algorithm, dtype
        return get_array_module(x).ascontiguousarray(sequence_slice(x, comm))

    def backward(self, grad: Any) -> Any:
        return gather_sequence(grad, self.comm, self.algorithm, self.dtype)


class JoinSequence(Function):
    """Out of the sequence-parallel region: the whole replicated activation; backward, this
    rank's slice (every tp rank computes the same loss from it)."""

    def forward(self, x: Any, comm: Communicator = None, algorithm: str = "auto",
                dtype: Any = None) -> Any:
        self.comm = comm
        return gather_sequence(x, comm, algorithm, dtype)

    def backward(self, grad: Any) -> Any:
        return get_array_module(grad).ascontiguousarray(sequence_slice(grad, self.comm))


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal scaled-dot-product attention of (B, H, T, hd) q, k and v."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _shard(data: Any, index: Any) -> nn.Parameter:
    """This rank's slice of a whole parameter, in a buffer of its own (a view of a row slice
    would keep the whole tensor alive after the pipeline releases it)."""
    xp = get_array_module(data)
    return nn.Parameter(xp.array(data[index], copy=True, order="C"))


class TPAttention(nn.Module):
    """Causal self-attention on this tp rank's heads (column-parallel qkv, row-parallel proj)."""

    def __init__(self, attn: Any, comm: Communicator, algorithm: str,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.comm, self.algorithm, self.sequence_parallel = comm, algorithm, sequence_parallel
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
        #: attention of this rank's (B, heads, T, hd) q, k, v (context parallelism swaps it)
        self.attend = causal_attention
        self.recompute_core = getattr(attn, "recompute_core", False)
        self.__dict__["shards"] = [(self.qkv_weight, attn.qkv.weight, rows),
                                   (self.qkv_bias, attn.qkv.bias, rows),
                                   (self.proj_weight, attn.proj.weight, cols)]

    def forward(self, x: Tensor) -> Tensor:
        dtype = amp.compute_dtype(self.qkv_weight.data)  # of the messages: 16-bit or as x
        x = (GatherSequence if self.sequence_parallel else CopyToTP).apply(
            x, comm=self.comm, algorithm=self.algorithm, dtype=dtype)
        b, t, _ = x.shape
        h = self.heads
        local = self.qkv_weight.shape[0] // 3
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias).reshape(b, t, 3, h, local // h)
        qkv = qkv.transpose(2, 0, 3, 1, 4)
        if self.recompute_core:
            y = checkpoint(self.attend, qkv[0], qkv[1], qkv[2])
        else:
            y = self.attend(qkv[0], qkv[1], qkv[2])
        y = F.linear(y.transpose(0, 2, 1, 3).reshape(b, t, local), self.proj_weight)
        y = (ReduceScatterSequence if self.sequence_parallel else ReduceFromTP).apply(
            y, comm=self.comm, algorithm=self.algorithm, dtype=dtype)
        return self.dropout(y + self.proj_bias)


class TPMLP(nn.Module):
    """The MLP on this tp rank's hidden units (column-parallel fc, row-parallel proj)."""

    def __init__(self, mlp: Any, comm: Communicator, algorithm: str,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.comm, self.algorithm, self.sequence_parallel = comm, algorithm, sequence_parallel
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
        dtype = amp.compute_dtype(self.fc_weight.data)  # of the messages: 16-bit or as x
        x = (GatherSequence if self.sequence_parallel else CopyToTP).apply(
            x, comm=self.comm, algorithm=self.algorithm, dtype=dtype)
        y = F.linear(F.gelu(F.linear(x, self.fc_weight, self.fc_bias)), self.proj_weight)
        y = (ReduceScatterSequence if self.sequence_parallel else ReduceFromTP).apply(
            y, comm=self.comm, algorithm=self.algorithm, dtype=dtype)
        return self.dropout(y + self.proj_bias)


class TPBlock(ResidualBlock):
    """A transformer block with tensor-parallel attention and MLP, replicated LayerNorms (with
    sequence parallelism: on this rank's slice of the sequence)."""

    def __init__(self, block: Any, comm: Communicator, algorithm: str,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.ln1, self.ln2 = block.ln1, block.ln2
        self.attn = TPAttention(block.attn, comm, algorithm, sequence_parallel)
        # a mixture of experts stays whole on every tp rank (replicated, like the LayerNorms)
        self.mlp = block.mlp if isinstance(block.mlp, MoE) \
            else TPMLP(block.mlp, comm, algorithm, sequence_parallel)
        self.recompute = getattr(block, "recompute", False)


class TensorParallelGPT(nn.Module):
    """A GPT whose blocks are split over `comm` (the tp axis); the rest is the GPT's own,
    replicated. Has the GPT's attribute names, so a pipeline cuts it like a GPT."""

    def __init__(self, gpt: Any, comm: Communicator, algorithm: str = "auto",
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        if gpt.n_head % comm.size:
            raise ValueError(f"tp: {comm.size} tensor-parallel ranks must divide the "
                             f"{gpt.n_head} heads")
        self.token_embedding, self.position_embedding = gpt.token_embedding, gpt.position_embedding
        self.dropout, self.ln_f = gpt.dropout, gpt.ln_f
        self.blocks = nn.ModuleList(TPBlock(b, comm, algorithm, sequence_parallel)
                                    for b in gpt.blocks)
        self.comm, self.algorithm, self.sequence_parallel = comm, algorithm, sequence_parallel
        self.__dict__["gpt"] = gpt  # not a submodule: its sharded weights are not trained here

    def forward(self, idx: Any) -> Tensor:
        xp = get_array_module(self.token_embedding.weight.data)
        data = xp.asarray(idx.data if isinstance(idx, Tensor) else idx)
        x = self.dropout(self.enter_sequence(self.token_embedding(data) + self.position_embedding(
            xp.arange(data.shape[1]))))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.leave_sequence(self.ln_f(x)), self.token_embedding.weight)

    def enter_sequence(self, x: Tensor) -> Tensor:
        """x as the blocks take it: this rank's slice with sequence parallelism, else x."""
        if not self.sequence_parallel:
            return x
        return SplitSequence.apply(x, comm=self.comm, algorithm=self.algorithm,
                                   dtype=amp.compute_dtype(self.token_embedding.weight.data))

    def leave_sequence(self, x: Tensor) -> Tensor:
        """The blocks' output made whole again for the output projection."""
        if not self.sequence_parallel:
            return x
        return JoinSequence.apply(x, comm=self.comm, algorithm=self.algorithm,
                                  dtype=amp.compute_dtype(self.token_embedding.weight.data))

    def sequence_parallel_params(self) -> list[Any]:
        """The parameters used on slices of the sequence (LayerNorms, row-parallel biases):
        with sequence parallelism each tp rank holds part of their gradient."""
        if not self.sequence_parallel:
            return []
        params = [*self.ln_f.parameters()]
        for b in self.blocks:
            params += [*b.ln1.parameters(), *b.ln2.parameters(), b.attn.proj_bias,
                       b.mlp.proj_bias]
        return params

    @property
    def shards(self) -> list[tuple[Any, Any, Any]]:
        """(shard, the GPT's whole parameter, index(t): where rank t's shard sits in it)."""
        return [entry for b in self.blocks for m in (b.attn, b.mlp)
                for entry in getattr(m, "shards", [])]

    def whole_map(self, parts: dict[int, Any], fn: Any, select: Any) -> dict[int, Any]:
        """`Optimizer.split`'s whole_map: each split matrix of `parts` all-gathered over tp, fn
        applied to it on every tp rank alike and this rank's slice kept; fn applied to the
        replicated ones as they are (collective over tp)."""
        out, split = {}, {id(shard) for shard, _, _ in self.shards}
        for shard, full, index in self.shards:  # in the same order on every tp rank
            if id(shard) in parts and len(full.shape) == 2 and select(full):
                whole = gather_array(parts[id(shard)], full.shape, index, self.comm)
                out[id(shard)] = fn(whole)[index(self.comm.rank)]
        out.update({k: fn(part) for k, part in parts.items() if k not in split})
        return out

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
