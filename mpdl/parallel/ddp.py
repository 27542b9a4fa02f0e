"""Data-parallel training: every rank holds a replica, gradients are averaged by all-reduce.

`DistributedDataParallel` follows PyTorch's Reducer. Parameters are packed, in reverse
registration order (roughly the order backward produces their gradients), into flat buckets
(`mpdl.parallel.buckets`): a small first bucket, then buckets of about `bucket_mb`. Each
parameter's grad-ready hook copies its gradient into its bucket slot; when every slot of a bucket
is filled, the bucket's all-reduce is handed to the communicator's communication thread and runs
while backward goes on. `finish()` waits for the buckets in order and reduces the last one (full
only when backward ends) itself, on the calling thread, which has nothing else to do; each
`p.grad` is then a view of its slot, which holds the averaged gradient (so a gradient is held
once, as with PyTorch's gradient_as_bucket_view, and the bucket is overwritten by the next step's
backward); call it between `loss.backward()` and `optimizer.step()`.

Each bucket's buffer is made once, with a persistent all-reduce plan of it
(`mpdl.tuning.allreduce_init`, in place), which every step runs. On one node the buffers lie
in shared memory of the node (`mpdl.collectives.shm.shared_array`), where the shm algorithm sums
them without copying them in or out, faster than any message-passing algorithm
(docs/results/training.md#data-parallel-training).

Overlap pays where the communication thread has something to hide: a wait for other nodes, or a
core of its own. On one node whose ranks have no core to spare (as many ranks as cores, or more),
an all-reduce is copies and additions that the communication thread could only run on the core
backward runs on, adding its thread handoffs: there every bucket is reduced by `finish()` on the
calling thread (`overlap_pays`), which makes the step faster there
(docs/results/training.md#data-parallel-training).

Buckets are launched in bucket order on every rank (a bucket that fills early waits for its
predecessors), so all ranks issue the same collectives in the same order whatever their graphs.
A parameter that got no gradient this step contributes zeros, filled in by `finish()`; no rank
waits for a gradient that never comes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from mpdl import memory, mpi_runtime
from mpdl.backend import get_array_module
from mpdl.collectives import shm
from mpdl.collectives.checks import pick
from mpdl.collectives.registry import resolve
from mpdl.comm import Communicator, as_communicator
from mpdl.comm.handles import Handle, comm_thread_for, run_in_order
from mpdl.parallel import buckets, flat
from mpdl.parallel.buckets import MB, FlatLayout
from mpdl.parallel.compression import GradientCompression, make_compression
from mpdl.tuning import Plan, allreduce_init


class Bucket(FlatLayout):
    """A flat gradient buffer for a run of parameters of one dtype and array module (a bucket of
    `mpdl.parallel.buckets.by_size`)."""

    def __init__(self, index: int, params: list[Any], shared_on: Communicator | None = None
                 ) -> None:
        """With `shared_on`, the buffer lies in shared memory of that communicator's node
        (`mpdl.collectives.shm.shared_array`; collective)."""
        super().__init__(params)
        self.index = index
        first = params[0].data
        self.buffer = get_array_module(first).zeros(self.count, dtype=first.dtype) \
            if shared_on is None else shm.shared_array(shared_on, self.count, first.dtype)
        memory.hold(self.buffer, "gradients")
        self.nbytes = int(self.buffer.nbytes)
        self.ready: set[int] = set()
        self.handle: Handle | None = None
        #: the persistent all-reduce of the buffer, in place (made by the DDP that owns it)
        self.plan: Plan | None = None
        #: (start, end) of the last all-reduce, in time.perf_counter seconds, measured on the
        #: thread that ran it
        self.span: tuple[float, float] = (0.0, 0.0)
        #: when the last step's gradients had all arrived in the bucket (time.perf_counter)
        self.ready_at = 0.0

    def view(self, p: Any) -> Any:
        return self.slot(self.buffer, p)

    @property
    def full(self) -> bool:
        return len(self.ready) == len(self.params)


class DistributedDataParallel:
    """Wrap `module` for data-parallel training over `comm` (default: MPI.COMM_WORLD).

    At construction, every rank checks that parameter and buffer names, shapes and dtypes match
    (ValueError naming the first difference otherwise) and then receives rank 0's values.
    Gradients are summed with the mpdl all-reduce `algorithm` (any name of
    `mpdl.collectives.algorithms("allreduce")`, or "auto") after each rank's local gradient is
    multiplied by `grad_weight` (1/p by default, so the result is the average; see
    `set_local_batch`). With `overlap=False`, and where overlap cannot pay (`overlap_pays`), all
    buckets are reduced in `finish()`; `self.overlap` says which.

    `compression` (a name of `mpdl.parallel.compression.COMPRESSORS` or a `GradientCompression`)
    sums each bucket through that compressor instead (all-reduce or all-gather of its payload,
    error feedback per bucket); the summed gradients are still bit-identical on every rank.
    """

    def __init__(self, module: Any, comm: Any = None, algorithm: str = "auto",
                 bucket_mb: float = 25.0, first_bucket_mb: float = 1.0, overlap: bool = True,
                 compression: Any = None) -> None:
        if not isinstance(algorithm, str):
            raise TypeError(f"algorithm: expected a name, got {type(algorithm).__name__}")
        if algorithm != "auto":
            resolve("allreduce", algorithm)
        for name, value in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name}: expected a positive number of megabytes, got {value!r}")
        self.module = module
        self.comm: Communicator = as_communicator(comm)
        self.algorithm = algorithm
        self.overlap = bool(overlap) and overlap_pays(self.comm)
        self.bucket_mb, self.first_bucket_mb = float(bucket_mb), float(first_bucket_mb)
        self.grad_weight = 1.0 / self.comm.size
        self.compression = _compression(compression, algorithm)
        self._sync = True
        self._next_launch = 0
        self._check_replicas()
        flat.broadcast_model(self.module, self.comm)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = self._make_buckets()
        self._plan_buckets()
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._hooks = [p.register_grad_ready_hook(self._on_grad_ready) for p in self.params]
        #: seconds of the last finish(): the main thread's wait (exposed communication) and the
        #: communication thread's all-reduce time
        self.last_exposed_s = 0.0
        self.last_comm_s = 0.0
        #: seconds the grad-ready hooks of the last synchronised backward took (bucket copies and
        #: launches)
        self.last_hook_s = 0.0
        self._hook_s = 0.0

    # -- construction ---------------------------------------------------------------------------
    def _check_replicas(self) -> None:
        mine = [(kind, name, tuple(t.shape), str(t.dtype)) for kind, items in
                (("parameter", self.module.named_parameters()),
                 ("buffer", self.module.named_buffers())) for name, t in items]
        everyone = self.comm.allgather_object(mine)
        for rank, theirs in enumerate(everyone):
            if theirs == everyone[0]:
                continue
            for i in range(max(len(theirs), len(everyone[0]))):
                a = everyone[0][i] if i < len(everyone[0]) else None
                b = theirs[i] if i < len(theirs) else None
                if a != b:
                    raise ValueError(
                        f"DistributedDataParallel: the model differs between ranks; entry {i} is "
                        f"{_describe(a)} on rank 0 but {_describe(b)} on rank {rank}")

    def _make_buckets(self) -> list[Bucket]:
        shared = self.comm if self._shares_buckets() else None
        groups = buckets.by_size(self.params, self.bucket_mb * MB, self.first_bucket_mb * MB)
        return [Bucket(i, ps, shared if get_array_module(ps[0].data) is np else None)
                for i, ps in enumerate(groups)]

    def _shares_buckets(self) -> bool:
        """Whether the buckets lie in shared memory (made collectively): one node, no
        compression, and an algorithm that can be shm, which then sums them where they lie."""
        return (self.comm.size > 1 and self.compression is None
                and self.algorithm in ("auto", "shm") and self.comm.has_shared_memory
                and len(self.comm.node_groups()) == 1)

    def _plan_buckets(self) -> None:
        """One persistent in-place all-reduce per bucket (without compression), made in bucket
        order on every rank (a persistent `mpi` plan is an MPI_Allreduce_init, which all ranks
        must make and start alike); "auto" is resolved once per bucket, by its size."""
        if self.compression is not None:
            return
        for b in self.buckets:
            b.plan = allreduce_init(b.buffer, op="sum", algorithm=self.algorithm, comm=self.comm,
                                    out=b.buffer)

    # -- the wrapped module ----------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    forward = __call__

    def parameters(self) -> list[Any]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, Any]]:
        return self.module.named_parameters()

    def state_dict(self) -> dict[str, np.ndarray]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        self.module.load_state_dict(state, strict)

    def train(self, mode: bool = True) -> DistributedDataParallel:
        self.module.train(mode)
        return self

    def eval(self) -> DistributedDataParallel:
        return self.train(False)

    # -- gradient weighting ----------------------------------------------------------------------
    def set_local_batch(self, local: int, global_: int) -> None:
        """Weight this rank's gradient by local/global_ before the sum, so that ranks with
        slices of unequal size still produce the gradient of the global batch's mean loss
        (each rank's loss being the mean over its own slice)."""
        if global_ <= 0 or not 0 <= local <= global_:
            raise ValueError(f"set_local_batch: expected 0 <= local <= global_ and global_ > 0, "
                             f"got local={local}, global_={global_}")
        self.grad_weight = local / global_

    # -- gradient synchronisation ------------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within the block, backward only accumulates local gradients (no communication); the
        first synchronised backward after it reduces the accumulated sum."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_grad_ready(self, p: Any) -> None:
        if not self._sync:
            return
        start = time.perf_counter()
        bucket = self._bucket_of[id(p)]
        if bucket.handle is not None or id(p) in bucket.ready:
            raise RuntimeError("DistributedDataParallel: a second backward ran before finish(); "
                               "call finish() between backward and the optimizer step, or use "
                               "no_sync() to accumulate gradients")
        self._fill(bucket, p)
        if bucket.full:
            bucket.ready_at = time.perf_counter()
            if self.overlap and bucket.index == self._next_launch:
                self._launch_ready()
        self._hook_s += time.perf_counter() - start

    def _fill(self, bucket: Bucket, p: Any) -> None:
        """Put p's weighted gradient into its bucket slot; p.grad becomes a view of the slot, so
        that each gradient is held once (PyTorch's gradient_as_bucket_view)."""
        slot = bucket.view(p)
        xp = get_array_module(slot)
        if p.grad is None:
            slot[...] = 0
        elif self.grad_weight == 1.0:
            xp.copyto(slot, p.grad)
        else:
            xp.multiply(p.grad, slot.dtype.type(self.grad_weight), out=slot)
        if p.requires_grad:
            p.grad = slot
        bucket.ready.add(id(p))

    def _launch_ready(self) -> None:
        """Hand the all-reduce of every full bucket from the next one on, in order, to the
        communication thread; the last bucket is left to `finish()`."""
        last = len(self.buckets) - 1
        while self._next_launch < last and self.buckets[self._next_launch].full:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        if self.comm.size == 1:
            bucket.handle = Handle()
            self._reduce(bucket)
            bucket.handle._finish()
        else:
            bucket.handle = comm_thread_for(self.comm).submit(lambda: self._reduce(bucket))

    def _reduce(self, bucket: Bucket) -> None:
        """Sum the bucket over the ranks, in place (its plan), and note when that ran."""
        start, buf = time.perf_counter(), bucket.buffer
        if bucket.plan is not None:
            bucket.plan()
        else:
            buf[...] = self.compression.aggregate(buf, self.comm, key=bucket.index,
                                                  shapes=[p.shape for p in bucket.params])
        bucket.span = (start, time.perf_counter())

    def finish(self) -> None:
        """Fill in the gradients that never came (zeros), wait for the buckets handed to the
        communication thread, reduce the rest here, in order, and write the result into each
        parameter's `.grad`.

        The buckets reduced here are those not launched during backward: the last one (it fills
        only when backward ends, and the caller would wait for it anyway) and, without overlap,
        all of them. Does nothing inside `no_sync()`. Every rank must call it once per
        synchronised step.
        """
        if not self._sync:
            return
        now = time.perf_counter()
        for bucket in self.buckets[self._next_launch:]:
            if not bucket.full:
                for p in bucket.params:
                    if id(p) not in bucket.ready:
                        self._fill_missing(bucket, p)
                bucket.ready_at = now
        waited = 0.0
        comm_s = 0.0
        try:
            for bucket in self.buckets:
                start = time.perf_counter()
                if bucket.handle is not None:
                    bucket.handle.wait()
                else:
                    # behind whatever else is in flight on the communication thread
                    run_in_order(self.comm, lambda b=bucket: self._reduce(b))
                waited += time.perf_counter() - start
                comm_s += bucket.span[1] - bucket.span[0]
                for p in bucket.params:
                    if p.requires_grad:
                        p.grad = bucket.view(p)  # the sum, in place in the bucket
        finally:
            for bucket in self.buckets:
                bucket.ready.clear()
                bucket.handle = None
            self._next_launch = 0
            self.last_hook_s, self._hook_s = self._hook_s, 0.0
        self.last_exposed_s, self.last_comm_s = waited, comm_s

    def _fill_missing(self, bucket: Bucket, p: Any) -> None:
        """A parameter whose hook did not fire this step contributes what it accumulated under
        no_sync(), or zeros."""
        self._fill(bucket, p)

    def model_state_bytes(self, optimizer: Any = None) -> int:
        """Bytes of model state this rank holds: parameters, buckets, gradients that are not
        views of a bucket, and `optimizer`'s per-parameter arrays (ZeRO's accounting for DDP)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        state = [] if optimizer is None else [v for s in optimizer.state.values()
                                              for v in s.values() if getattr(v, "ndim", 0) > 0]
        return int(sum(p.data.nbytes for p in self.params) + sum(b.nbytes for b in self.buckets)
                   + sum(g.nbytes for g in grads if not self._in_a_bucket(g))
                   + sum(v.nbytes for v in state))

    def _in_a_bucket(self, array: Any) -> bool:
        """Whether array is (a view of) a bucket's buffer."""
        return any(get_array_module(b.buffer) is get_array_module(array)
                   and get_array_module(array).may_share_memory(array, b.buffer)
                   for b in self.buckets)

    def bucket_spans(self) -> list[tuple[int, float, float]]:
        """(bucket index, start, end) of each bucket's last all-reduce (time.perf_counter)."""
        return [(b.index, *b.span) for b in self.buckets]

    def bucket_ready_times(self) -> list[float]:
        """When each bucket's gradients had all arrived in the last step (time.perf_counter; for
        a bucket completed with zeros by `finish()`, when finish began)."""
        return [b.ready_at for b in self.buckets]

    def bucket_algorithms(self) -> list[str]:
        """The all-reduce algorithm each bucket runs ("auto" resolved by bucket size)."""
        return [b.plan.algorithm if b.plan is not None else
                pick("allreduce", self.algorithm, self.comm, b.nbytes).name
                for b in self.buckets]

    def remove_hooks(self) -> None:
        """Detach from the module's parameters (the module keeps working on its own)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def overlap_pays(comm: Communicator) -> bool:
    """Whether a communication thread can hide comm's all-reduces behind backward: comm spans
    nodes (real or emulated: there is waiting to hide), or the launcher puts fewer ranks on this
    node than this process may use cores (a core is free for the thread), or it does not say (the
    in-process world). Collective the first time (the node layout)."""
    if comm.size == 1 or len(comm.node_groups()) > 1:
        return True
    local = mpi_runtime.launcher_local_size()
    return local is None or local < mpi_runtime.usable_cores()


def _compression(compression: Any, algorithm: str) -> Any:
    """None, or the GradientCompression that `compression` (a name or an instance) stands for."""
    if compression is None or isinstance(compression, GradientCompression):
        return compression
    if not isinstance(compression, str):
        raise TypeError(f"compression: expected a name or a GradientCompression, got "
                        f"{type(compression).__name__}")
    return make_compression(compression, algorithm=algorithm)


def _describe(entry: tuple | None) -> str:
    if entry is None:
        return "missing"
    kind, name, shape, dtype = entry
    return f"{kind} {name!r} {shape} {dtype}"
