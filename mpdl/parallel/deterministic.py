"""Deterministic data parallelism: the same parameters, to the last bit, on any rank count,
any all-reduce or reduce-scatter algorithm and any ZeRO stage.

Float addition is not associative, so a sum of gradients depends on the order an algorithm adds
them in. Here nothing is added in floating point across samples:

1. **Atoms.** Every global batch is cut into the same `atoms` contiguous pieces
   (`block_bounds`), whatever the layout; a rank trains on whole atoms (the sampler's `atoms`
   option) and runs each atom's forward and backward on its own, so an atom's gradient is the
   same computation, with the same shapes, on every rank. Its loss is the sum over its targets
   divided by the global batch's count of targets, known before any backward.
2. **Exact sums.** Each parameter tensor gets one exponent E per step: the max all-reduce of its
   largest |gradient| over all atoms (a max is exact in any order). Each atom's gradient is
   rounded to the integer grid 2^(E - S), with S = 62 - ceil(log2 atoms), into int64, so that no
   sum of atoms can overflow. Integer addition is associative: the local sum over atoms and the
   all-reduce (or reduce-scatter) over ranks give the same integers in any order, and the
   gradient is those integers times 2^(E - S), the same bits everywhere. Values below
   2^(E - S) of the largest are rounded, about 2^-60 of it: far below float32's resolution.
3. **Elementwise updates.** SGD and Adam update each element on its own, so a rank that updates
   a shard (ZeRO) gets the bits a rank that updates everything gets.

`exact_sum` is the library switch: any caller with per-atom gradients gets the exact sum.
`DeterministicStrategy` is the training strategy (`mpdl train --deterministic`); with `zero`
> 0 the gradient is reduce-scattered, each rank updates its block of the flat parameters (its
optimizer state is that block's only) and the blocks are all-gathered. `param_sha256` hashes a
model's parameters in its canonical names and order.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Any

import numpy as np

from mpdl.autograd import functional as F
from mpdl.autograd.tensor import Tensor
from mpdl.collectives import allgather, allreduce, broadcast, reduce_scatter
from mpdl.collectives.ops import block_bounds
from mpdl.comm import Communicator
from mpdl.models.moe import aux_loss_scale
from mpdl.parallel import flat
from mpdl.parallel.strategy import Batch, MakeOptimizer, Span, StepResult, Strategy, correct_predictions

#: the default number of atoms a global batch is cut into
DEFAULT_ATOMS = 8


def grid_bits(atoms: int) -> int:
    """S: an atom's gradient is at most 2^S grid steps, so that `atoms` of them fit in int64."""
    return 62 - math.ceil(math.log2(max(int(atoms), 1)))


def exponents(maxima: np.ndarray) -> np.ndarray:
    """E per tensor: the smallest power of two above each (non-negative) maximum."""
    return np.frexp(np.asarray(maxima, dtype=np.float64))[1].astype(np.float64)


def quantize(grad: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """An atom's flat gradient as int64 grid steps (`scale` per element: 2^(S - E))."""
    return np.rint(grad.astype(np.float64) * scale).astype(np.int64)


def exact_sum(atom_grads: list[np.ndarray], sizes: list[int], atoms: int, comm: Communicator,
              algorithm: str = "auto", shard: bool = False, dtype: Any = np.float32
              ) -> np.ndarray:
    """The sum over every rank's atoms of flat gradients (this rank's in `atom_grads`, each
    made of tensors of `sizes` elements; `atoms` over all ranks), in `dtype`, the same bits on
    any rank count and algorithm. With `shard`, this rank's block (block_bounds) of it.
    Collective."""
    total = sum(sizes)
    starts = np.cumsum([0, *sizes[:-1]])
    local_max = np.zeros(len(sizes), dtype=np.float64)
    for g in atom_grads:
        if total:
            local_max = np.maximum(local_max, np.maximum.reduceat(np.abs(g), starts))
    E = exponents(allreduce(local_max, op="max", comm=comm))
    S = grid_bits(atoms)
    scale = np.repeat(np.exp2(S - E), sizes)
    q = np.zeros(total, dtype=np.int64)
    for g in atom_grads:
        q += quantize(g, scale)
    unit = np.repeat(np.exp2(E - S), sizes)
    if shard:
        bounds = block_bounds(total, comm.size)
        lo, hi = bounds[comm.rank], bounds[comm.rank + 1]
        q = reduce_scatter(q, op="sum", algorithm=algorithm, comm=comm)
        unit = unit[lo:hi]
    else:
        q = allreduce(q, op="sum", algorithm=algorithm, comm=comm)
    return (q.astype(np.float64) * unit).astype(dtype)


def param_sha256(named: Any) -> str:
    """SHA-256 of (name, dtype, shape, bytes) of each (name, tensor) in `named`, in its order."""
    h = hashlib.sha256()
    for name, t in named:
        data = np.ascontiguousarray(getattr(t, "data", t))
        h.update(f"{name}:{data.dtype.str}:{data.shape};".encode())
        h.update(data.tobytes())
    return h.hexdigest()


class DeterministicStrategy(Strategy):
    """Every rank holds the whole model; each step trains this rank's atoms one by one and sums
    their gradients exactly (`exact_sum`); `zero` > 0 shards the update and the optimizer state
    (reduce-scatter, update of this rank's block, all-gather)."""

    mode = "deterministic"

    def __init__(self, comm: Communicator, algorithm: str = "auto", zero: int = 0,
                 atoms: int = DEFAULT_ATOMS) -> None:
        super().__init__(comm)
        self.algorithm, self.zero, self.atoms = algorithm, int(zero), int(atoms)
        self.params: list[Any] = []
        self.shard: Tensor | None = None
        self.sent_bytes = 0

    def setup(self, model: Any, make_optimizer: MakeOptimizer) -> None:
        self.model = model
        tensors = [t for _, t in model.named_parameters()] + model.buffers()
        if self.comm.size > 1:
            for group in flat.by_kind(tensors):
                result = broadcast(flat.pack([t.data for t in group]), root=0, comm=self.comm)
                for t, piece in zip(group, flat.unpack(result, group), strict=True):
                    t.data[...] = piece
        self.params = [p for p in model.parameters() if p.requires_grad]
        dtypes = {p.data.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"DeterministicStrategy: expected parameters of one dtype, got "
                             f"{sorted(str(d) for d in dtypes)}")
        self.sizes = [p.size for p in self.params]
        if self.zero:
            bounds = block_bounds(sum(self.sizes), self.comm.size)
            self.lo, self.hi = bounds[self.comm.rank], bounds[self.comm.rank + 1]
            self.shard = Tensor(self._flat_params()[self.lo:self.hi].copy(), requires_grad=True)
            self.optimizer = make_optimizer([self.shard])
        else:
            self.optimizer = make_optimizer(self.params)

    def _flat_params(self) -> np.ndarray:
        return np.concatenate([p.data.reshape(-1) for p in self.params])

    def _atom_gradient(self, batch: Batch, result: StepResult) -> np.ndarray:
        """Forward and backward of one atom: its flat gradient of sum-of-losses / count (and of
        its MoE layers' load-balancing losses times the atom's share of the batch)."""
        start = time.perf_counter()
        with aux_loss_scale(len(batch.y) / batch.global_size):  # MoE layers: the atom's share
            logits = self.model(Tensor(batch.x))
            loss = F.cross_entropy(logits, batch.y, reduction="sum")
            forward_end = time.perf_counter()
            loss.backward(1.0 / batch.count)
        end = time.perf_counter()
        result.loss += float(loss.item()) * batch.global_size / batch.count
        result.correct += correct_predictions(logits.data, batch.y)
        result.samples += len(batch.y)
        result.spans += [Span("forward", start, forward_end), Span("backward", forward_end, end)]
        grad = np.concatenate([np.zeros(p.size, dtype=p.data.dtype) if p.grad is None
                               else p.grad.reshape(-1) for p in self.params])
        self.model.zero_grad()
        return grad

    def step(self, batch: Batch) -> StepResult:
        if batch.atoms is None or batch.count <= 0:
            raise ValueError("DeterministicStrategy.step: expected a batch with its atoms and "
                             "the global count of targets")
        self.optimizer.lr = batch.lr
        result = StepResult()
        start = time.perf_counter()
        grads, offset = [], 0
        for size in batch.atoms:
            part = Batch(batch.x[offset:offset + size], batch.y[offset:offset + size],
                         batch.global_size, batch.lr, count=batch.count)
            offset += size
            grads.append(self._atom_gradient(part, result))
        computed = time.perf_counter()
        grad = exact_sum(grads, self.sizes, self.atoms, self.comm, self.algorithm,
                         shard=bool(self.zero), dtype=self.params[0].data.dtype)
        summed = time.perf_counter()
        if self.zero:
            self.shard.data[...] = self._flat_params()[self.lo:self.hi]  # loaded weights too
            self.shard.grad = grad
            self.optimizer.step()
            self.optimizer.zero_grad()
            gathered = time.perf_counter()
            whole = allgather(self.shard.data, algorithm=self.algorithm, comm=self.comm,
                              count=sum(self.sizes))
            for p, piece in zip(self.params, np.split(whole, np.cumsum(self.sizes)[:-1]),
                                strict=True):
                p.data[...] = piece.reshape(p.shape)
            comm_s = (summed - computed) + (time.perf_counter() - gathered)
        else:
            for p, piece in zip(self.params, np.split(grad, np.cumsum(self.sizes)[:-1]),
                                strict=True):
                p.grad = piece.reshape(p.shape)
            self.optimizer.step()
            self.optimizer.zero_grad()
            comm_s = summed - computed
        end = time.perf_counter()
        result.comm_s = result.exposed_s = comm_s
        result.compute_s = (end - start) - comm_s
        result.spans += [Span("exact sum", computed, summed, cat="communication"),
                         Span("optimizer step", summed, end)]
        return result

    def state_dict(self) -> dict[str, Any]:
        if self.zero:
            raise NotImplementedError("--deterministic with --zero keeps no checkpoint")
        return super().state_dict()

    def describe(self, final: bool = False) -> str:
        if final:
            return ""
        zero = f", ZeRO {self.zero} (sharded update)" if self.zero else ""
        return (f"deterministic: {self.atoms} atoms a batch, exact int64 sums over "
                f"{self.algorithm}{zero}")

    def report(self, final: bool = False) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "mode": self.mode, "atoms": self.atoms,
                "zero": self.zero}
