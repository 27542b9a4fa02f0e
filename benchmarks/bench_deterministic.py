"""The cost of `--deterministic` against the float path, interleaved in one run.

    mpiexec -n 2 python benchmarks/bench_deterministic.py [--model mlp|gpt] [--steps 30]

Per step (ring all-reduce), on the same global batch and model: the float path (DDP, float32
buckets, `--grad-accum` = atoms per rank, so both run the same forward/backward shapes, and
with --grad-accum 1) and the deterministic path (atoms, exact int64 sums). Prints the median
step time of each, their ratio, and the bytes each rank hands the all-reduce per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from mpdl.autograd import optim
from mpdl.comm import as_communicator
from mpdl.models.zoo import build_model
from mpdl.parallel import DistributedSampler
from mpdl.parallel.data_parallel import AllReduceStrategy
from mpdl.parallel.deterministic import DeterministicStrategy
from mpdl.parallel.strategy import Batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--atoms", type=int, default=8)
    args = ap.parse_args()
    comm = as_communicator(MPI.COMM_WORLD)
    rng = np.random.default_rng(0)
    if args.model == "mlp":
        x = rng.standard_normal((args.batch, 64)).astype(np.float32)
        y = rng.integers(0, 10, args.batch)
        make = lambda: build_model("mlp", (64,), 10, seed=1)  # noqa: E731
    else:
        x = rng.integers(0, 12, (args.batch, 11))
        y = rng.integers(0, 12, (args.batch, 11))
        y[:, :7] = -100
        make = lambda: build_model("gpt", (11,), 12, seed=1, n_layer=2, n_head=4,  # noqa: E731
                                   n_embd=32)
    sampler = DistributedSampler(args.batch, args.batch, rank=comm.rank, num_replicas=comm.size,
                                 shuffle=False, atoms=args.atoms)
    idx = sampler.local_slice(np.arange(args.batch))
    count = int((y >= 0).sum())
    atoms = sampler.local_atoms(args.batch)
    paths = {"float": AllReduceStrategy(comm, algorithm="ring"),
             "float, accumulated per atom": AllReduceStrategy(comm, algorithm="ring",
                                                              grad_accum=max(len(atoms), 1)),
             "deterministic": DeterministicStrategy(comm, algorithm="ring", atoms=args.atoms)}
    for s in paths.values():
        s.setup(make(), lambda p: optim.SGD(p, lr=1e-3, momentum=0.9))
    times: dict[str, list[float]] = {name: [] for name in paths}
    for step in range(args.steps + 3):  # the first 3: warm-up, not counted
        for name, s in paths.items():
            batch = Batch(x[idx], y[idx], args.batch, 1e-3, count=count, atoms=atoms)
            comm.barrier()
            start = time.perf_counter()
            s.step(batch)
            if step >= 3:
                times[name].append(time.perf_counter() - start)
    n = sum(p.size for p in paths["float"].model.parameters())
    tensors = len(paths["float"].model.parameters())
    if comm.rank == 0:
        base = statistics.median(times["float"])
        print(f"# {args.model}: {n} parameters in {tensors} tensors, global batch {args.batch}, "
              f"{args.atoms} atoms, {comm.size} ranks, {args.steps} steps interleaved")
        sent = {"float": 4 * n, "float, accumulated per atom": 4 * n,
                "deterministic": 8 * n + 8 * tensors}
        for name, t in times.items():
            med = statistics.median(t)
            print(f"{name:28s} step {med * 1e3:8.2f} ms  x{med / base:5.2f}  "
                  f"all-reduced {sent[name]:>9,d} B/step")


if __name__ == "__main__":
    main()
