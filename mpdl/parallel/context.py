"""Context parallelism: attention over a sequence split across the cp ranks.

Each of the C ranks of `comm` holds a slice of the sequence: the sequence is cut into chunks of
equal length and rank r holds

    contiguous:  chunk r of C                    (picotron's split)
    zigzag:      chunks r and 2C−1−r of 2C       (Megatron's and PyTorch's load balance)

With a causal mask, query chunk a sees key chunk b wholly when b < a, triangularly when b = a and
not at all when b > a. Under the contiguous split rank C−1 sees every chunk and rank 0 only its
own, so the last rank does about 2C−1 times the work of the first and every ring step waits for
it; under zigzag every rank does the same work (each rank holds an early and a late chunk: a pair
of chunks from any other rank costs exactly half of a full block).

Three ways to compute attention for the local queries (`context_attention`, all autograd
Functions over mpdl's own messages and collectives):

- **ring** (Liu et al. 2023, ring attention): the K/V blocks travel around the ring, rank r
  sending to r+1 with non-blocking messages while it computes attention of its queries against
  the block it holds; the partial outputs merge with a running log-sum-exp (online softmax).
  Backward sends the K/V blocks around once more, each with the dK/dV sums of the ranks it has
  visited, and after C steps each block's gradient is home. Bytes per rank and layer, forward:
  2·(C−1)/C of the whole sequence's K and V.
- **allgather** (Llama 3): all-gather K and V, attend locally, reduce-scatter dK and dV.
- **ulysses** (DeepSpeed-Ulysses): an all-to-all turns "all heads, my positions" into "my heads,
  all positions" for Q, K and V; attention is then local; an all-to-all turns the output back.
  Needs heads divisible by C.

`reference_attention` is the naive version: gather Q, K, V, run whole-sequence attention, keep
this rank's rows (forward only; for teaching and checking).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

import mpdl.autograd.functional as F
from mpdl.autograd.tensor import Function, Tensor
from mpdl.backend import get_array_module
from mpdl.collectives import allgather, alltoall, reduce_scatter
from mpdl.comm import Communicator
from mpdl.comm.handles import Handle, comm_thread_for

CP_MODES = ("ring", "allgather", "ulysses")
CP_BALANCES = ("zigzag", "contiguous")


# -- which rank holds which positions -----------------------------------------------------------
def chunks_per_rank(balance: str) -> int:
    """How many chunks of the sequence each rank holds: 2 under zigzag, 1 contiguous."""
    if balance not in CP_BALANCES:
        raise ValueError(f"cp_balance: expected one of {', '.join(CP_BALANCES)}, got {balance!r}")
    return 2 if balance == "zigzag" else 1


def chunks_of(rank: int, cp: int, balance: str) -> list[int]:
    """The chunk indices rank `rank` of `cp` holds, in the order they sit in its slice."""
    return [rank, 2 * cp - 1 - rank] if chunks_per_rank(balance) == 2 else [rank]


def check_sequence(length: int, cp: int, balance: str) -> None:
    """Raise ValueError unless a sequence of `length` splits into cp·chunks equal chunks."""
    n = cp * chunks_per_rank(balance)
    if length % n:
        raise ValueError(f"cp: the sequence length {length} must be divisible by "
                         f"{'2·cp' if n != cp else 'cp'} = {n} ({balance} split over {cp} ranks)")


def positions(rank: int, cp: int, length: int, balance: str) -> np.ndarray:
    """The global positions (0..length−1) that rank `rank` of `cp` holds, in its order."""
    check_sequence(length, cp, balance)
    n = cp * chunks_per_rank(balance)
    size = length // n
    return np.concatenate([np.arange(c * size, (c + 1) * size) for c in chunks_of(rank, cp,
                                                                                   balance)])


def shard_sequence(x: Any, rank: int, cp: int, balance: str, axis: int = 1) -> Any:
    """Rank `rank`'s slice of x along the sequence axis `axis`."""
    xp = get_array_module(x)
    index = positions(rank, cp, x.shape[axis], balance)
    return xp.take(x, xp.asarray(index), axis=axis)


def block_work(rank: int, cp: int, balance: str, causal: bool = True) -> float:
    """The attention work of rank `rank` in units of one full chunk-by-chunk block."""
    mine, total = chunks_of(rank, cp, balance), 0.0
    for src in range(cp):
        for a in mine:
            for b in chunks_of(src, cp, balance):
                kind = _kind(a, b, causal)
                total += 0.0 if kind is None else (0.5 if kind == "causal" else 1.0)
    return total


# -- one block: softmax(q kᵀ · scale) v with its log-sum-exp, and its gradients -----------------
def _kind(a: int, b: int, causal: bool) -> str | None:
    """How query chunk a sees key chunk b: "full", "causal" (the diagonal) or None (not at all)."""
    if not causal or b < a:
        return "full"
    return "causal" if a == b else None


def _scores(q: Any, k: Any, mask: Any, scale: float) -> Any:
    xp = get_array_module(q)
    s = q @ xp.swapaxes(k, -1, -2)
    s *= scale
    if mask is not None:
        s = xp.where(xp.asarray(mask), -xp.inf, s)
    return s


def _block_forward(q: Any, k: Any, v: Any, mask: Any, scale: float) -> tuple[Any, Any]:
    """(softmax(q kᵀ · scale) v, the log-sum-exp of each query's scores); `mask` (Tq, Tk) hides
    the True entries (every query must see at least one key)."""
    xp = get_array_module(q)
    s = _scores(q, k, mask, scale)
    top = s.max(axis=-1, keepdims=True)
    s -= top
    xp.exp(s, out=s)
    total = s.sum(axis=-1, keepdims=True)
    out = (s @ v) / total
    return out, (top + xp.log(total))[..., 0]


def _block_backward(q: Any, k: Any, v: Any, dout: Any, delta: Any, lse: Any, mask: Any,
                    scale: float) -> tuple[Any, Any, Any]:
    """The gradients (dq, dk, dv) of one block's share of the output, given the final
    log-sum-exp of each query and delta = Σ dout·out per query (the softmax's correction)."""
    xp = get_array_module(q)
    p = _scores(q, k, mask, scale)
    p -= lse[..., None]
    xp.exp(p, out=p)
    dv = xp.swapaxes(p, -1, -2) @ dout
    ds = dout @ xp.swapaxes(v, -1, -2)
    ds -= delta[..., None]
    ds *= p
    ds *= scale
    return ds @ k, xp.swapaxes(ds, -1, -2) @ q, dv


def _merge(out: Any, lse: Any, block_out: Any, block_lse: Any) -> None:
    """Fold a block's normalised output and log-sum-exp into the running (out, lse), in place."""
    xp = get_array_module(out)
    new = xp.logaddexp(lse, block_lse)
    out *= xp.exp(lse - new)[..., None]
    out += xp.exp(block_lse - new)[..., None] * block_out
    lse[...] = new


def _pairs(mine: list[int], theirs: list[int], length: int, causal: bool):
    """(query slice, key slice, mask) of each chunk pair that sees anything, where `length` is
    the chunk length and both sides lay their chunks out in the given order."""
    for i, a in enumerate(mine):
        for j, b in enumerate(theirs):
            kind = _kind(a, b, causal)
            if kind is None:
                continue
            mask = np.triu(np.ones((length, length), dtype=bool), 1) if kind == "causal" else None
            yield slice(i * length, (i + 1) * length), slice(j * length, (j + 1) * length), mask


def _attend(q: Any, k: Any, v: Any, mine: list[int], theirs: list[int], causal: bool,
            scale: float, out: Any, lse: Any) -> None:
    """Fold the attention of the local queries (chunks `mine`) to one K/V block (chunks
    `theirs`) into (out, lse)."""
    length = q.shape[-2] // len(mine)
    for qs, ks, mask in _pairs(mine, theirs, length, causal):
        block_out, block_lse = _block_forward(q[..., qs, :], k[..., ks, :], v[..., ks, :], mask,
                                              scale)
        _merge(out[..., qs, :], lse[..., qs], block_out, block_lse)


def _attend_backward(q: Any, k: Any, v: Any, dout: Any, delta: Any, lse: Any, mine: list[int],
                     theirs: list[int], causal: bool, scale: float, dq: Any, dk: Any,
                     dv: Any) -> None:
    """Add one K/V block's part of the gradients into dq and into that block's dk, dv."""
    length = q.shape[-2] // len(mine)
    for qs, ks, mask in _pairs(mine, theirs, length, causal):
        gq, gk, gv = _block_backward(q[..., qs, :], k[..., ks, :], v[..., ks, :],
                                     dout[..., qs, :], delta[..., qs], lse[..., qs], mask, scale)
        dq[..., qs, :] += gq
        dk[..., ks, :] += gk
        dv[..., ks, :] += gv


def _pack(*arrays: Any) -> Any:
    """The arrays stacked into one C-contiguous message buffer."""
    xp = get_array_module(arrays[0])
    return xp.ascontiguousarray(xp.stack(arrays))


def _tally(timings: dict | None, key: str, value: float) -> None:
    if timings is not None:
        timings[key] = timings.get(key, 0.0) + value


# -- ring ----------------------------------------------------------------------------------------
def _shift(comm: Communicator, block: Any, step: Any) -> tuple[Any, Handle]:
    """Start passing `block` on around the ring (to rank r+1, receiving rank r−1's) on the
    communicator's communication thread, so that it travels while this thread computes: (the
    receive buffer, the handle to wait on). Shifts run in the order they are started."""
    xp = get_array_module(block)
    incoming = xp.empty_like(block)
    cp, r = comm.size, comm.rank
    handle = comm_thread_for(comm).submit(
        lambda: comm.sendrecv(block, (r + 1) % cp, incoming, (r - 1) % cp, step))
    return incoming, handle


def _wait(handle: Handle, timings: dict | None) -> None:
    start = time.perf_counter()
    handle.wait()
    _tally(timings, "wait_s", time.perf_counter() - start)


class RingAttention(Function):
    """Ring attention over `comm`: q, k, v (B, H, T/C, D) this rank's slice; the output is
    this rank's rows of the whole sequence's attention."""

    def forward(self, q: Any, k: Any, v: Any, comm: Communicator = None, causal: bool = True,
                balance: str = "zigzag", scale: float = 1.0, timings: dict | None = None) -> Any:
        xp = get_array_module(q)
        cp, r = comm.size, comm.rank
        mine = chunks_of(r, cp, balance)
        out = xp.zeros_like(q)
        lse = xp.full(q.shape[:-1], -xp.inf, dtype=q.dtype)
        kv = _pack(k, v)
        with comm.recording("ring_attention", "ring", kv.nbytes, str(kv.dtype)):
            for step in range(cp):
                if step + 1 < cp:  # the next block travels while this one is attended to
                    incoming, handle = _shift(comm, kv, ("kv", step))
                    _tally(timings, "bytes", kv.nbytes)
                start = time.perf_counter()
                _attend(q, kv[0], kv[1], mine, chunks_of((r - step) % cp, cp, balance), causal,
                        scale, out, lse)
                _tally(timings, "compute_s", time.perf_counter() - start)
                if step + 1 < cp:
                    _wait(handle, timings)
                    kv = incoming
        self.saved = (q, k, v, out, lse)
        self.comm, self.causal, self.balance, self.scale, self.timings = (
            comm, causal, balance, scale, timings)
        return out

    def backward(self, grad: Any) -> tuple[Any, Any, Any]:
        q, k, v, out, lse = self.saved
        comm, causal, balance, scale = self.comm, self.causal, self.balance, self.scale
        xp = get_array_module(q)
        cp, r = comm.size, comm.rank
        mine = chunks_of(r, cp, balance)
        delta = (grad * out).sum(axis=-1)
        dq = xp.zeros_like(q)
        kv = _pack(k, v)
        # the dK/dV sums of the ranks that the block now arriving has visited, and their shift
        sums: Any = None
        sums_handle: Handle | None = None
        with comm.recording("ring_attention_backward", "ring", kv.nbytes, str(kv.dtype)):
            for step in range(cp):
                if step + 1 < cp:
                    incoming, handle = _shift(comm, kv, ("kv", step))
                dkv = xp.zeros_like(kv)
                start = time.perf_counter()
                _attend_backward(q, kv[0], kv[1], grad, delta, lse, mine,
                                 chunks_of((r - step) % cp, cp, balance), causal, scale, dq,
                                 dkv[0], dkv[1])
                _tally(self.timings, "compute_s", time.perf_counter() - start)
                if cp == 1:
                    return dq, dkv[0], dkv[1]
                if sums_handle is not None:  # they travelled while this block was computed
                    _wait(sums_handle, self.timings)
                    dkv += sums
                sums, sums_handle = _shift(comm, dkv, ("dkv", step))
                if step + 1 < cp:
                    _wait(handle, self.timings)
                    kv = incoming
            _wait(sums_handle, self.timings)  # after C steps each block's gradient is home
        return dq, sums[0], sums[1]


# -- all-gather ----------------------------------------------------------------------------------
class AllGatherAttention(Function):
    """K and V all-gathered over `comm` (Llama 3); backward reduce-scatters dK and dV. The
    gathered K/V are not kept: backward gathers them again."""

    def forward(self, q: Any, k: Any, v: Any, comm: Communicator = None, causal: bool = True,
                balance: str = "zigzag", scale: float = 1.0, timings: dict | None = None) -> Any:
        xp = get_array_module(q)
        cp, r = comm.size, comm.rank
        everyone = _gather_kv(k, v, comm, timings)
        out = xp.zeros_like(q)
        lse = xp.full(q.shape[:-1], -xp.inf, dtype=q.dtype)
        start = time.perf_counter()
        for src in range(cp):
            _attend(q, everyone[src, 0], everyone[src, 1], chunks_of(r, cp, balance),
                    chunks_of(src, cp, balance), causal, scale, out, lse)
        _tally(timings, "compute_s", time.perf_counter() - start)
        self.saved = (q, k, v, out, lse)
        self.comm, self.causal, self.balance, self.scale, self.timings = (
            comm, causal, balance, scale, timings)
        return out

    def backward(self, grad: Any) -> tuple[Any, Any, Any]:
        q, k, v, out, lse = self.saved
        comm, balance = self.comm, self.balance
        xp = get_array_module(q)
        cp, r = comm.size, comm.rank
        everyone = _gather_kv(k, v, comm, self.timings)
        delta = (grad * out).sum(axis=-1)
        dq, dkv = xp.zeros_like(q), xp.zeros_like(everyone)
        for src in range(cp):
            _attend_backward(q, everyone[src, 0], everyone[src, 1], grad, delta, lse,
                             chunks_of(r, cp, balance), chunks_of(src, cp, balance), self.causal,
                             self.scale, dq, dkv[src, 0], dkv[src, 1])
        mine = reduce_scatter(dkv, op="sum", comm=comm).reshape(2, *k.shape)
        return dq, mine[0], mine[1]


def _gather_kv(k: Any, v: Any, comm: Communicator, timings: dict | None) -> Any:
    """Every rank's (k, v), shape (C, 2, *k.shape)."""
    start = time.perf_counter()
    everyone = allgather(_pack(k, v), comm=comm).reshape(comm.size, 2, *k.shape)
    _tally(timings, "wait_s", time.perf_counter() - start)
    _tally(timings, "bytes", 2 * k.nbytes * (comm.size - 1))
    return everyone


# -- Ulysses -------------------------------------------------------------------------------------
class UlyssesAttention(Function):
    """DeepSpeed-Ulysses over `comm`: an all-to-all sends head group j of this rank's q, k, v
    to rank j and gathers every rank's positions of this rank's head group; attention runs on
    the whole sequence for H/C heads; an all-to-all sends each rank's rows of the output back."""

    def forward(self, q: Any, k: Any, v: Any, comm: Communicator = None, causal: bool = True,
                balance: str = "zigzag", scale: float = 1.0, timings: dict | None = None) -> Any:
        xp = get_array_module(q)
        cp = comm.size
        b, h, t, d = q.shape
        heads = h // cp
        self.comm, self.scale, self.timings = comm, scale, timings
        send = _pack(q, k, v).reshape(3, b, cp, heads, t, d)
        whole = self._exchange(xp.moveaxis(send, 2, 0), timings)  # (C, 3, B, H/C, T/C, D)
        whole = xp.moveaxis(whole, 0, 3).reshape(3, b, heads, cp * t, d)
        order = np.concatenate([positions(r, cp, cp * t, balance) for r in range(cp)])
        mask = order[None, :] > order[:, None] if causal else None  # in the ranks' order
        start = time.perf_counter()
        out, lse = _block_forward(whole[0], whole[1], whole[2], mask, scale)
        _tally(timings, "compute_s", time.perf_counter() - start)
        back = self._exchange(xp.moveaxis(out.reshape(b, heads, cp, t, d), 2, 0), timings)
        self.saved = (whole, out, lse, mask)
        return xp.moveaxis(back, 0, 1).reshape(b, h, t, d)

    def _exchange(self, blocks: Any, timings: dict | None) -> Any:
        """All-to-all of (C, ...) blocks: block j to rank j; block i of the result from rank i."""
        xp = get_array_module(blocks)
        start = time.perf_counter()
        received = alltoall(xp.ascontiguousarray(blocks), comm=self.comm)
        _tally(timings, "wait_s", time.perf_counter() - start)
        _tally(timings, "bytes", blocks.nbytes * (blocks.shape[0] - 1) // blocks.shape[0])
        return received

    def backward(self, grad: Any) -> tuple[Any, Any, Any]:
        whole, out, lse, mask = self.saved
        xp = get_array_module(grad)
        cp = self.comm.size
        b, h, t, d = grad.shape
        heads = h // cp
        dout = self._exchange(xp.moveaxis(grad.reshape(b, cp, heads, t, d), 1, 0), self.timings)
        dout = xp.moveaxis(dout, 0, 2).reshape(b, heads, cp * t, d)
        delta = (dout * out).sum(axis=-1)
        grads = xp.stack(_block_backward(whole[0], whole[1], whole[2], dout, delta, lse, mask,
                                         self.scale))
        mine = self._exchange(xp.moveaxis(grads.reshape(3, b, heads, cp, t, d), 3, 0),
                              self.timings)
        mine = xp.moveaxis(mine, 0, 2).reshape(3, b, h, t, d)
        return mine[0], mine[1], mine[2]


# -- the naive version ---------------------------------------------------------------------------
def reference_attention(q: Any, k: Any, v: Any, comm: Communicator, causal: bool = True,
                        balance: str = "zigzag") -> Any:
    """This rank's rows of whole-sequence attention, the plain way: all-gather q, k and v
    (arrays (B, H, T/C, D)), put every position in its place, attend, keep this rank's rows."""
    xp = get_array_module(q)
    cp = comm.size
    length = q.shape[-2] * cp
    order = np.concatenate([positions(r, cp, length, balance) for r in range(cp)])
    qkv = allgather(_pack(q, k, v), comm=comm).reshape(cp, 3, *q.shape)
    whole = xp.empty((3, *q.shape[:-2], length, q.shape[-1]), dtype=q.dtype)
    whole[..., xp.asarray(order), :] = xp.moveaxis(qkv, 0, -3).reshape(whole.shape)
    out = F.scaled_dot_product_attention(whole[0], whole[1], whole[2], is_causal=causal).data
    return out[..., xp.asarray(positions(comm.rank, cp, length, balance)), :]


# -- the entry point -----------------------------------------------------------------------------
def context_attention(q: Tensor, k: Tensor, v: Tensor, comm: Communicator, mode: str = "ring",
                      balance: str = "zigzag", causal: bool = True, scale: float | None = None,
                      timings: dict | None = None) -> Tensor:
    """Attention of this rank's queries over the whole sequence, split over `comm` as `balance`
    says (q, k, v: (B, H, T/C, D) Tensors, this rank's positions in the order of `positions`).
    `timings`, a dict, gains compute_s, wait_s (exposed communication) and bytes sent."""
    if mode not in CP_MODES:
        raise ValueError(f"cp_mode: expected one of {', '.join(CP_MODES)}, got {mode!r}")
    check_sequence(q.shape[-2] * comm.size, comm.size, balance)
    if mode == "ulysses" and q.shape[-3] % comm.size:
        raise ValueError(f"cp_mode ulysses: the {q.shape[-3]} heads must be divisible by cp = "
                         f"{comm.size}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    kind = {"ring": RingAttention, "allgather": AllGatherAttention,
            "ulysses": UlyssesAttention}[mode]
    return kind.apply(q, k, v, comm=comm, causal=causal, balance=balance, scale=scale,
                      timings=timings)
