"""Context parallelism measured: attention over a sequence split across the ranks, against one
rank, the ring's messages hidden behind attention, the three modes and the two splits, bytes per
rank against the formulas, and activation bytes per rank.

    mpiexec -n 4 python benchmarks/bench_cp.py [--lengths 512 1024 2048 4096] [--reps 3]
                                               [--json PATH]

C = the world size. For each sequence length T (batch 1, 4 heads of 16, float32):

- step: forward + backward of causal attention with `context_attention` (ring zigzag, ring
  contiguous, all-gather zigzag, Ulysses zigzag) over C ranks, against the same attention of the
  whole sequence on rank 0 alone (mpdl's scaled_dot_product_attention); in turns, the slowest
  rank's time, median over reps.
- hidden: the share of the ring's K/V messages hidden behind attention in forward, 1 − (time
  waited for the messages) / (time the same C−1 messages take alone, blocking, measured in turn).
  With more ranks than cores a rank's wait is mostly waiting for a core: measure it with as many
  ranks as cores.
- work: the causal blocks of the most loaded rank over the mean (1.0 is balanced): what the
  contiguous split costs.
- bytes: bytes each rank sends in one forward, against the formulas: ring and all-gather
  2·(C−1)/C of the whole sequence's K and V (each rank its K/V block to C−1 others); Ulysses
  4·(C−1)/C·N·h/C (q, k, v and the output, each rank's N/C × h block less the part it keeps).
- activations: bytes the autograd graph keeps for backward (every array saved on the graph's
  nodes, counted once), per rank, at C and on one rank.

Then a GPT block stack (2 layers, n_embd 64, 4 heads) on the in-process world at tp = 2: the
bytes each rank sends per step and the activation bytes kept, plain tensor parallelism against
Megatron sequence parallelism (same bytes, fewer activations).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
from mpi4py import MPI

import mpdl.autograd.functional as F
from mpdl.autograd import optim
from mpdl.autograd.tensor import Tensor
from mpdl.comm import as_communicator
from mpdl.models.gpt import GPT
from mpdl.parallel.context import block_work, context_attention, shard_sequence
from mpdl.parallel.pipeline import PipelineStrategy
from mpdl.parallel.strategy import Batch
from mpdl.threadworld import run_world

HEADS, HEAD_DIM = 4, 16
VARIANTS = [("ring", "zigzag"), ("ring", "contiguous"), ("allgather", "zigzag"),
            ("ulysses", "zigzag")]


def graph_bytes(root: Tensor) -> int:
    """Bytes of the arrays the graph under `root` keeps for backward (each array once)."""
    seen: set[int] = set()
    arrays: dict[int, int] = {}
    stack = [root]
    while stack:
        t = stack.pop()
        ctx = getattr(t, "_ctx", None)
        if ctx is None or id(ctx) in seen:
            continue
        seen.add(id(ctx))
        for value in vars(ctx).values():
            for a in value if isinstance(value, tuple) else (value,):
                if isinstance(a, np.ndarray) and a.size > 1:
                    base = a if a.base is None else a.base
                    arrays[id(base)] = base.nbytes
        stack.extend(ctx.inputs or ())
    return sum(arrays.values())


def slowest(comm: Any, seconds: float) -> float:
    return comm.allreduce(seconds, op=MPI.MAX)


def attention_step(comm: Any, mpdl_comm: Any, qkv: list[np.ndarray], mode: str, balance: str,
                   timings: dict | None = None, backward: bool = True) -> tuple[float, int]:
    """(the slowest rank's seconds, this rank's graph bytes) of one forward (+ backward)."""
    c = mpdl_comm.size
    local = [Tensor(shard_sequence(a, comm.rank, c, balance, axis=2), requires_grad=backward)
             for a in qkv]
    comm.Barrier()
    start = time.perf_counter()
    out = context_attention(*local, mpdl_comm, mode, balance, timings=timings)
    kept = graph_bytes(out) if backward else 0
    if backward:
        out.sum().backward()
    return slowest(comm, time.perf_counter() - start), kept


def one_rank_step(comm: Any, qkv: list[np.ndarray]) -> tuple[float, int]:
    comm.Barrier()
    start = time.perf_counter()
    kept = 0
    if comm.rank == 0:
        q, k, v = (Tensor(a, requires_grad=True) for a in qkv)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        kept = graph_bytes(out)
        out.sum().backward()
    seconds = time.perf_counter() - start
    comm.Barrier()
    return seconds if comm.rank == 0 else 0.0, kept


def ring_messages_alone(comm: Any, nbytes: int) -> float:
    """Seconds of C−1 blocking ring shifts of an nbytes block (the slowest rank's)."""
    c, r = comm.size, comm.rank
    send, recv = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(c - 1):
        comm.Sendrecv(send, (r + 1) % c, recvbuf=recv, source=(r - 1) % c)
        send, recv = recv, send
    return slowest(comm, time.perf_counter() - start)


def attention_rows(comm: Any, lengths: list[int], reps: int) -> list[dict]:
    mpdl_comm = as_communicator(comm)
    c, rows = comm.size, []
    for length in lengths:
        qkv = [np.random.default_rng(i).standard_normal((1, HEADS, length, HEAD_DIM))
               .astype(np.float32) for i in range(3)]
        times: dict[str, list[float]] = {"one": []}
        kept: dict[str, int] = {}
        hidden, alone = [], []
        for _ in range(reps):  # in turns
            seconds, kept["one"] = one_rank_step(comm, qkv)
            times["one"].append(seconds)
            for mode, balance in VARIANTS:
                seconds, mine = attention_step(comm, mpdl_comm, qkv, mode, balance)
                times.setdefault(f"{mode}/{balance}", []).append(seconds)
                kept[f"{mode}/{balance}"] = comm.allreduce(mine, op=MPI.MAX)
            timings: dict[str, float] = {}
            attention_step(comm, mpdl_comm, qkv, "ring", "zigzag", timings, backward=False)
            block = 2 * HEADS * (length // c) * HEAD_DIM * 4
            alone.append(ring_messages_alone(comm, block))
            hidden.append(comm.allreduce(timings["wait_s"], op=MPI.MAX))
        sent = {}
        for mode in ("ring", "allgather", "ulysses"):
            timings = {}
            attention_step(comm, mpdl_comm, qkv, mode, "zigzag", timings, backward=False)
            sent[mode] = int(timings["bytes"])
        kv_bytes = 2 * HEADS * length * HEAD_DIM * 4
        n_h = length * HEADS * HEAD_DIM * 4
        work = [block_work(r, c, b) for b in ("zigzag", "contiguous") for r in range(c)]
        row = {"T": length, "C": c,
               "one_rank_s": float(np.median(times["one"])),
               **{f"{k}_s": float(np.median(v)) for k, v in times.items() if k != "one"},
               "ring_wait_s": float(np.median(hidden)), "ring_messages_alone_s":
                   float(np.median(alone)),
               "hidden_share": max(0.0, 1 - float(np.median(hidden)) / float(np.median(alone))),
               "work_max_over_mean_zigzag": max(work[:c]) / np.mean(work[:c]),
               "work_max_over_mean_contiguous": max(work[c:]) / np.mean(work[c:]),
               "bytes_ring": sent["ring"], "formula_ring": int(kv_bytes * (c - 1) / c),
               "bytes_allgather": sent["allgather"], "formula_allgather":
                   int(kv_bytes * (c - 1) / c),
               "bytes_ulysses": sent["ulysses"],
               "formula_ulysses": int(4 * n_h / c * (c - 1) / c),
               "activations_one_rank": kept["one"],
               **{f"activations_{k}": v for k, v in kept.items() if k != "one"}}
        rows.append(row)
    return rows


def sequence_parallel_rows(length: int = 64) -> list[dict]:
    """Bytes sent per rank and activation bytes per rank of one GPT step at tp = 2, with and
    without sequence parallelism, from the in-process world's message log."""
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 50, (4, length)), rng.integers(0, 50, (4, length))
    rows = []
    for sp in (False, True):
        def body(comm, sp=sp, measure=False):
            s = PipelineStrategy(comm, 1, 1, 2, sp=sp)
            s.setup(GPT(vocab_size=50, block_size=length, n_layer=2, n_head=4, n_embd=64, seed=0),
                    lambda p: optim.SGD(p, lr=0.1))
            if not measure:
                return s.step(Batch(x, y, len(y), 0.1)).loss
            h = Tensor(x)
            for piece in s.pieces:
                h = piece(h)
            return graph_bytes(h)
        losses, log = run_world(2, body, message_log=True)
        kept = run_world(2, lambda comm, body=body: body(comm, measure=True))
        sent = sum(m[4] for m in log if m[2] == 0)
        rows.append({"sp": sp, "bytes_sent_rank0": sent, "activations_rank0": kept[0],
                     "loss": losses[0]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rows = attention_rows(comm, args.lengths, args.reps)
    if comm.rank != 0:
        return
    mib = 1 << 20
    print(f"# causal attention fwd+bwd, batch 1, {HEADS} heads of {HEAD_DIM}, float32, "
          f"C = {comm.size}; seconds (slowest rank, median of {args.reps})")
    print(f"{'T':>5} {'1 rank':>8} " + " ".join(f"{m + '/' + b[:3]:>13}" for m, b in VARIANTS)
          + f" {'hidden':>7} {'work zz':>8} {'work cont':>9}")
    for r in rows:
        print(f"{r['T']:>5} {r['one_rank_s']:>8.4f} "
              + " ".join(f"{r[f'{m}/{b}_s']:>13.4f}" for m, b in VARIANTS)
              + f" {r['hidden_share']:>7.0%} {r['work_max_over_mean_zigzag']:>8.2f} "
                f"{r['work_max_over_mean_contiguous']:>9.2f}")
    print("# bytes sent per rank in one forward (measured / formula) and activation MiB kept "
          "per rank")
    print(f"{'T':>5} {'ring':>16} {'allgather':>16} {'ulysses':>16} {'1 rank':>8} "
          f"{'ring':>8} {'allgather':>9} {'ulysses':>8}")
    for r in rows:
        print(f"{r['T']:>5} " + " ".join(f"{r[f'bytes_{m}']:>8}/{r[f'formula_{m}']:<7}"
                                         for m in ("ring", "allgather", "ulysses"))
              + f" {r['activations_one_rank'] / mib:>8.2f} "
                f"{r['activations_ring/zigzag'] / mib:>8.2f} "
                f"{r['activations_allgather/zigzag'] / mib:>9.2f} "
                f"{r['activations_ulysses/zigzag'] / mib:>8.2f}")
    sp_rows = sequence_parallel_rows()
    print("# GPT, 2 layers, n_embd 64, T 64, batch 4, tp 2: one step on the in-process world")
    for r in sp_rows:
        print(f"{'Megatron SP' if r['sp'] else 'plain TP':>12}: bytes sent by rank 0 "
              f"{r['bytes_sent_rank0']}, activation bytes kept {r['activations_rank0']}, "
              f"loss {r['loss']:.6f}")
    if args.json:
        with open(args.json, "w") as f:
            for r in [*rows, *sp_rows]:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
