"""Replica groups that survive the loss of a group, on MPI's fault tolerance (ULFM), naive version.

The world's P ranks form G groups of P/G consecutive ranks (slots). Every step each rank calls
`ReplicaGroups.average(arrays, samples)`: one all-reduce of its arrays times its sample count,
then an `Agree` (ULFM's fault-tolerant agreement) that every rank finished it. A rank that died
makes one of the two fail on every survivor; they `Revoke` and `Shrink` the communicator, learn
which slots are gone, and redo the all-reduce with the complete groups only (the quorum), the
members of a broken group adding zeros. The result is the mean over the samples the live groups
processed. At the step boundary `admit(state)` spawns a process for every dead slot
(`Comm.Spawn`, merged back into one communicator in slot order), and every rank of the lost group
receives the weights, optimizer state and step from the first live group: no checkpoint read.

Needs Open MPI 5 started with ``mpiexec --with-ft ulfm``; MPICH's wheel has no ULFM that works
here (docs/resilience.md#replica-groups-over-ulfm). A second failure during a recovery is not
handled.

Run the demo: ``mpiexec --with-ft ulfm -n 4 python -m mpdl.parallel.replicas --groups 2``
(``MPDL_FAULT=kill:SLOT:STEP`` kills a slot after that step).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

import numpy as np

from mpdl.mpi_runtime import library_version, load_mpi


class ReplicaGroupsUnavailable(RuntimeError):
    """The MPI library or the way it was started has no usable ULFM."""


def require_ulfm(MPI: Any) -> None:
    """Raise ReplicaGroupsUnavailable unless this is Open MPI started with ``--with-ft ulfm``."""
    version = library_version(MPI)
    if "Open MPI" not in version:
        raise ReplicaGroupsUnavailable(
            f"replica groups need ULFM: Open MPI 5 started with `mpiexec --with-ft ulfm` "
            f"(this MPI is {version})")
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true"):
        raise ReplicaGroupsUnavailable(
            "replica groups need ULFM: start the job with `mpiexec --with-ft ulfm`")


class ReplicaGroups:
    """`groups` replica groups over the ranks of `comm` (an mpi4py communicator, COMM_WORLD
    unless given); built in a process spawned to replace a dead one, it joins the survivors."""

    def __init__(self, groups: int, comm: Any = None, argv: list[str] | None = None) -> None:
        self.MPI = MPI = load_mpi()
        require_ulfm(MPI)
        parent = MPI.Comm.Get_parent()
        #: the command a replacement process runs (this process's own, by default)
        self.argv = argv or [sys.executable, *sys.argv]
        #: JSON events: group_lost and group_rejoined
        self.events: list[dict[str, Any]] = []
        self.pending: list[int] = []  # dead slots, replaced at the next admit()
        self.lost_groups: list[int] = []
        self.fault_time = 0.0
        #: the slot that reports the events: the first slot of the first live group
        self.reporter = 0
        #: the state a replacement received from a live group (None in an original process)
        self.joined_state: dict[str, Any] | None = None
        if parent != MPI.COMM_NULL:
            self._join(parent)
            return
        world = (comm or MPI.COMM_WORLD).Dup()
        if groups < 1 or world.Get_size() % groups:
            raise ValueError(f"groups={groups}: expected a divisor of the {world.Get_size()} ranks")
        world.Set_errhandler(MPI.ERRORS_RETURN)
        self.comm, self.groups = world, groups
        self.group_size = world.Get_size() // groups
        self.slot = world.Get_rank()
        self.live = list(range(world.Get_size()))

    @property
    def group(self) -> int:
        """This rank's group."""
        return self.slot // self.group_size

    def quorum(self) -> list[int]:
        """The groups whose every slot is alive."""
        return [g for g in range(self.groups)
                if all(s in self.live for s in range(g * self.group_size, (g + 1) * self.group_size))]

    def average(self, arrays: list[np.ndarray], samples: int, step: int) -> tuple[list[np.ndarray], int]:
        """The sample-weighted mean of `arrays` (each the mean over this rank's `samples`) over the
        ranks of the live groups, and their total samples; survives the loss of groups."""
        flat = np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays] + [np.ones(1)])
        while True:
            weight = samples if self.group in self.quorum() else 0
            total = np.empty_like(flat)
            try:
                self.comm.Allreduce(flat * weight, total)
                self.comm.Agree(1)
                break
            except self.MPI.Exception:
                self._shrink(step)
        count = int(round(total[-1]))
        out, offset = [], 0
        for a in arrays:
            out.append((total[offset:offset + a.size] / count).reshape(a.shape))
            offset += a.size
        return out, count

    def _shrink(self, step: int) -> None:
        """Drop the dead ranks from the communicator and note the groups lost."""
        if not self.pending:
            self.fault_time = time.monotonic()
        self.comm.Revoke()
        self.comm = self.comm.Shrink()
        self.comm.Set_errhandler(self.MPI.ERRORS_RETURN)
        before = set(self.quorum())
        self.live = sorted(self.comm.allgather(self.slot))
        self.pending = sorted(set(range(self.groups * self.group_size)) - set(self.live))
        if not self.quorum():
            raise RuntimeError("every replica group lost a rank: no live group to copy the state from")
        self.reporter = self.quorum()[0] * self.group_size
        for g in sorted(before - set(self.quorum())):
            self.lost_groups.append(g)
            self.events.append({"event": "group_lost", "group": g, "step": step})

    def admit(self, state: dict[str, Any], step: int) -> dict[str, Any] | None:
        """At a step boundary, replace the dead slots and send every rank of a lost group the
        `state` of the first live group; returns the state this rank must load, or None."""
        if not self.pending:
            return None
        inter = self.comm.Spawn(self.argv[0], self.argv[1:], maxprocs=len(self.pending), root=0)
        merged = inter.Merge(high=False)
        merged.bcast({"pending": self.pending, "groups": self.groups, "group_size": self.group_size}, root=0)
        received = self._reorder(merged, state)
        inter.Disconnect()  # MPI_Finalize waits for connected processes
        seconds = time.monotonic() - self.fault_time  # from the survivors' first error
        for g in self.lost_groups:
            self.events.append({"event": "group_rejoined", "group": g, "step": step,
                                "seconds": round(seconds, 3)})
        self.lost_groups = []
        return received

    def _join(self, parent: Any) -> None:
        """In a replacement process: merge with the survivors and take a dead slot."""
        merged = parent.Merge(high=True)
        layout = merged.bcast(None, root=0)
        self.groups, self.group_size = layout["groups"], layout["group_size"]
        self.pending = layout["pending"]
        self.slot = self.pending[merged.Get_rank() - (merged.Get_size() - len(self.pending))]
        self.joined_state = self._reorder(merged, None)
        parent.Disconnect()

    def _reorder(self, merged: Any, state: dict[str, Any] | None) -> dict[str, Any] | None:
        """Order the merged communicator by slot and broadcast the first live group's state."""
        self.comm = merged.Split(0, self.slot)
        merged.Free()
        self.comm.Set_errhandler(self.MPI.ERRORS_RETURN)
        lost = {s // self.group_size for s in self.pending}
        self.reporter = min(s for s in range(self.comm.Get_size()) if s // self.group_size not in lost)
        received = self.comm.bcast(state if self.slot == self.reporter else None, root=self.reporter)
        self.pending, self.live = [], list(range(self.comm.Get_size()))
        return received if self.group in lost else None


def batch(seed: int, step: int, slot: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The demo's data: slot's batch of step (4 + slot samples of y = x·w* + noise, w* from seed)."""
    w_true = np.random.default_rng(seed).standard_normal(dim)
    rng = np.random.default_rng([seed, step, slot])
    x = rng.standard_normal((4 + slot, dim))
    return x, x @ w_true + 0.1 * rng.standard_normal(4 + slot)


def main(argv: list[str] | None = None) -> int:
    """The demo: least squares by SGD with momentum in replica groups; JSON lines on slot 0."""
    parser = argparse.ArgumentParser(prog="python -m mpdl.parallel.replicas")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--kill-every", type=int, default=0, metavar="K",
                        help="SIGKILL the first rank of group (s/K mod G) after every step s divisible by K")
    args = parser.parse_args(argv)
    from mpdl import faults  # noqa: PLC0415
    try:
        rg = ReplicaGroups(args.groups, argv=[sys.executable, "-m", "mpdl.parallel.replicas",
                                              *(sys.argv[1:] if argv is None else argv)])
    except (ReplicaGroupsUnavailable, ValueError) as exc:
        print(f"mpdl: {exc}", file=sys.stderr)
        return 2
    state = rg.joined_state or {"w": np.zeros(args.dim), "v": np.zeros(args.dim), "step": 0}
    joined_at = None if rg.joined_state is None else state["step"]
    w, v, step = state["w"], state["v"], state["step"]
    started = time.monotonic()
    while step < args.steps:
        x, y = batch(args.seed, step, rg.slot, args.dim)
        (grad,), _ = rg.average([2 * x.T @ (x @ w - y) / len(y)], len(y), step)
        v = 0.9 * v + grad
        w = w - args.lr * v
        step += 1
        received = rg.admit({"w": w, "v": v, "step": step}, step)
        if received is not None:
            w, v = received["w"], received["v"]
        for event in rg.events:
            if rg.slot == rg.reporter:
                print(json.dumps(event), flush=True)
        rg.events.clear()
        faults.after_step(rg.slot, step, joined_at, iter(()))
        if args.kill_every and step % args.kill_every == 0 and step < args.steps \
                and rg.slot == step // args.kill_every % rg.groups * rg.group_size:
            os.kill(os.getpid(), signal.SIGKILL)
    digests = rg.comm.allgather(hashlib.sha256(w.tobytes()).hexdigest())
    if rg.slot == 0:
        print(json.dumps({"step": step, "seconds": round(time.monotonic() - started, 3),
                          "replica_sha256": digests[::rg.group_size], "rank_sha256": digests,
                          "w": w.tolist()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
