"""Gradient compression and the parameter server against plain all-reduce, in one run.

    mpiexec -n 4 python benchmarks/bench_compression.py [--epochs 8] [--hidden 256]
    MPDL_EMULATE="inter=10Gbit/s,20us" MPDL_RANKS_PER_NODE=1 mpiexec -n 4 python ...

An MLP (64-hidden-hidden-10) trains on the UCI digits with DistributedDataParallel, once per
compressor; the runs are interleaved epoch by epoch (none, fp16, topk, ... none, fp16, ...) so that
machine noise hits them alike. Then the same model trains with the parameter server (1 server,
p - 1 workers; sync, async and ssp with staleness 2), which cannot be interleaved with the
all-reduce runs (other rank roles). Per run: bytes this rank sends per step (counted at mpdl's
point-to-point layer for DDP; header + shard per push for the PS), median step time (slowest rank)
and its ratio to `none`, and the final test accuracy. With MPDL_EMULATE and MPDL_RANKS_PER_NODE=1
every message crosses an emulated slow link.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpdl import emulation
from mpdl.autograd import functional as F
from mpdl.autograd import nn
from mpdl.autograd.optim import SGD
from mpdl.autograd.tensor import Tensor
from mpdl.comm import as_communicator
from mpdl.datasets import load_digits
from mpdl.parallel import COMPRESSORS, DistributedDataParallel, DistributedSampler, ParameterServer
from mpdl.parallel.compression import make_compression


def mlp(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden, seed=1), nn.ReLU(), nn.Linear(hidden, hidden, seed=2),
                         nn.ReLU(), nn.Linear(hidden, 10, seed=3))


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    return float((model(Tensor(x)).data.argmax(1) == y).mean())


class Run:
    """One DDP training run with one compressor."""

    def __init__(self, name: str, hidden: int, comm, args) -> None:
        self.name = name
        self.model = mlp(hidden)
        dgc = name == "topk"
        compression = make_compression(name, ratio=args.ratio, levels=args.levels, rank=args.rank,
                                       momentum=0.9 if dgc else 0.0, warmup_steps=20,
                                       algorithm=args.algorithm)
        self.ddp = DistributedDataParallel(self.model, comm=comm, compression=compression,
                                           algorithm=args.algorithm, overlap=False)
        self.opt = SGD(self.model.parameters(), lr=args.lr,
                       momentum=0.0 if name in ("topk", "signsgd") else 0.9)
        self.times: list[float] = []
        self.bytes: list[int] = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--levels", type=int, default=16)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--algorithm", default="ring",
                        help="all-reduce/all-gather algorithm (default ring: its messages are "
                             "counted; the shared-memory one sends none)")
    parser.add_argument("--no-ps", action="store_true", help="skip the parameter-server rows")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    p, rank = world.Get_size(), world.Get_rank()
    comm = as_communicator(None)
    xtr, ytr, xte, yte = load_digits(seed=0)
    runs = [Run(name, args.hidden, comm, args) for name in COMPRESSORS]
    sampler = DistributedSampler(len(xtr), args.batch, rank=rank, num_replicas=p, seed=0)
    comm.message_log = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        for run in runs:
            for idx, global_batch in batches:
                comm.message_log.clear()
                world.Barrier()
                start = time.perf_counter()
                run.ddp.set_local_batch(len(idx), global_batch)
                if len(idx):
                    F.cross_entropy(run.model(Tensor(xtr[idx])), ytr[idx]).backward()
                run.ddp.finish()
                run.opt.step()
                run.opt.zero_grad()
                run.times.append(time.perf_counter() - start)
                run.bytes.append(sum(m[4] for m in comm.message_log))
    comm.message_log = None
    rows = []
    for run in runs:
        slowest = np.max(world.allgather(np.array(run.times)), axis=0)
        rows.append((f"ddp {run.name}", float(np.mean(run.bytes)), float(np.median(slowest)),
                     accuracy(run.model, xte, yte)))
    if not args.no_ps and p >= 2:
        for mode, staleness in (("sync", None), ("async", None), ("ssp", 2)):
            rows.append(ps_row(mode, staleness, args, xtr, ytr, xte, yte))
    if rank == 0:
        link = emulation.active(comm)
        count = sum(q.size for q in runs[0].model.parameters())
        print(f"# {p} ranks, MLP 64-{args.hidden}-{args.hidden}-10 ({count} parameters, "
              f"{count * 4} B of float32 gradients), digits, global batch {args.batch}, "
              f"{args.epochs} epochs; link: {link.describe() if link else 'not emulated'}")
        print(f"# collectives: {args.algorithm}; topk ratio {args.ratio}, qsgd {args.levels} "
              f"levels, powersgd rank {args.rank}; step time = median over steps of the slowest rank")
        print(f"{'run':>14} {'sent B/step':>12} {'vs dense':>9} {'step ms':>8} {'vs none':>8} "
              f"{'test acc':>8}")
        dense_bytes, dense_t = rows[0][1], rows[0][2]
        for name, nbytes, t, acc in rows:
            print(f"{name:>14} {nbytes:>12.0f} {nbytes / dense_bytes if dense_bytes else 1:>9.3f} "
                  f"{t * 1e3:>8.2f} {t / dense_t:>8.2f} {acc:>8.3f}")


def ps_row(mode: str, staleness: int | None, args, xtr, ytr, xte, yte):
    """Train with the parameter server; (label, bytes a worker sends per step, median step time
    over the workers' slowest, test accuracy)."""
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    model = mlp(args.hidden)
    ps = ParameterServer(model, servers=1, mode=mode, staleness=staleness)
    times: list[float] = []
    if ps.is_server:
        ps.serve(lambda params: SGD(params, lr=args.lr, momentum=0.9 if mode == "sync" else 0.5))
    else:
        sampler = DistributedSampler(len(xtr), args.batch, rank=rank, num_replicas=ps.workers,
                                     seed=0)
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for idx, global_batch in sampler:
                if mode == "sync":
                    ps.group.barrier()
                start = time.perf_counter()
                if len(idx):
                    F.cross_entropy(model(Tensor(xtr[idx])), ytr[idx]).backward()
                share = len(idx) / global_batch
                ps.push_pull(args.lr if mode == "sync" else 2 * args.lr * share, weight=share)
                for q in model.parameters():
                    q.grad = None
                times.append(time.perf_counter() - start)
        ps.close()
    acc = accuracy(model, xte, yte)
    count = sum(q.size for q in model.parameters())
    everyone = [t for t in world.allgather(times) if t]
    step = float(np.median(np.max(np.array(everyone), axis=0)))
    label = f"ps {mode}" + (f" s={staleness}" if staleness is not None else "")
    return label, float(count * 4 + 32), step, acc


if __name__ == "__main__":
    main()
