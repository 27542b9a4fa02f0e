"""The data-parallel strategies: all-reduce DDP (optionally compressed), local SGD and the parameter
server, each behind the `mpdl.parallel.strategy.Strategy` interface."""

from __future__ import annotations

import time
from typing import Any

from mpdl.autograd import optim
from mpdl.comm import Communicator
from mpdl.parallel.compression import GradientCompression
from mpdl.parallel.ddp import DistributedDataParallel
from mpdl.parallel.diloco import DiLoCo, allreduce_bytes
from mpdl.parallel.localsgd import LocalSGD
from mpdl.parallel.ps import ParameterServer, format_histogram
from mpdl.parallel.strategy import (
    Batch,
    MakeOptimizer,
    Span,
    StepResult,
    Strategy,
    grad_norm,
    microbatches,
)


class AllReduceStrategy(Strategy):
    """Every rank holds a replica; each step all-reduces the gradients in buckets that overlap
    backward (DistributedDataParallel), through `compression` if given."""

    mode = "allreduce"

    def __init__(self, comm: Communicator, algorithm: str = "auto", bucket_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, overlap: bool = True,
                 compression: GradientCompression | None = None, grad_accum: int = 1) -> None:
        super().__init__(comm)
        self.algorithm, self.overlap, self.compression = algorithm, overlap, compression
        #: microbatches per step: the first grad_accum - 1 accumulate locally (no_sync)
        self.grad_accum = grad_accum
        self.bucket_mb, self.first_bucket_mb = bucket_mb, first_bucket_mb
        self.ddp: Any = None
        #: the bytes this rank sent in all-reduces (mpdl.parallel.diloco.allreduce_bytes)
        self.allreduce_bytes = 0

    def setup(self, model: Any, make_optimizer: MakeOptimizer) -> None:
        self.model = model
        self.ddp = DistributedDataParallel(model, comm=self.comm, algorithm=self.algorithm,
                                           bucket_mb=self.bucket_mb,
                                           first_bucket_mb=self.first_bucket_mb,
                                           overlap=self.overlap, compression=self.compression)
        self.optimizer = make_optimizer(model.parameters())

    def step(self, batch: Batch) -> StepResult:
        self.optimizer.lr = batch.lr
        by_count = batch.count > 0  # each part's loss is already over the step's count
        if by_count:
            self.ddp.set_local_batch(1, 1)
        else:
            self.ddp.set_local_batch(len(batch.y), batch.global_size)
        result = StepResult()
        start = time.perf_counter()
        parts = microbatches(batch, self.grad_accum)
        with self.ddp.no_sync():
            for part, share in parts[:-1]:
                self.forward_backward(part, result, share, by_count)
        backward_end = self.forward_backward(parts[-1][0], result, parts[-1][1], by_count)
        self.ddp.finish()
        self._count_bytes()
        waited = time.perf_counter()
        self.optimizer.step()  # every replica holds the whole summed gradient: its norm is local
        result.grad_norm = grad_norm(self.optimizer)
        self.optimizer.zero_grad()
        end = time.perf_counter()
        result.exposed_s, result.comm_s = self.ddp.last_exposed_s, self.ddp.last_comm_s
        result.compute_s = (end - start) - result.exposed_s
        result.spans += [Span("finish (wait for all-reduce)", backward_end, waited, cat="wait"),
                         Span("optimizer step", waited, end)]
        result.spans += [Span(f"all-reduce bucket {b.index}", *b.span, cat="communication",
                              thread="comm", args={"bytes": b.nbytes}) for b in self.ddp.buckets]
        return result

    def _count_bytes(self) -> None:
        """Add this step's all-reduces to `allreduce_bytes` (a compressor's payload instead of
        the buckets' when compressing)."""
        if self.compression is not None:
            payload = self.compression.last_wire_bytes
        else:
            payload = sum(b.nbytes for b in self.ddp.buckets)
        self.allreduce_bytes += allreduce_bytes(payload, self.comm.size)

    def describe(self, final: bool = False) -> str:
        if final:
            return ""
        sizes = ", ".join(f"{b.nbytes / 1024:.0f} KiB" for b in self.ddp.buckets)
        overlap = "on" if self.ddp.overlap else "off (no core to spare)" if self.overlap else "off"
        return f"all-reduce {self.algorithm}, buckets [{sizes}], overlap {overlap}"

    def report(self, final: bool = False) -> dict[str, Any]:
        fields: dict[str, Any] = {"algorithm": self.algorithm, "mode": self.mode}
        if final:
            buckets = [b.nbytes for b in self.ddp.buckets]
            fields.update(bucket_algorithms=self.ddp.bucket_algorithms(), buckets=len(buckets),
                          bucket_bytes=buckets, allreduce_bytes=self.total_allreduce_bytes())
        return fields

    def total_allreduce_bytes(self) -> int:
        """The bytes this rank sent in all-reduces so far."""
        return self.allreduce_bytes


class LocalSGDStrategy(AllReduceStrategy):
    """Local SGD (post-local SGD with `warmup_steps`): all-reduce steps during the warmup, then
    local steps with the parameters averaged every `sync_every` steps."""

    def __init__(self, comm: Communicator, sync_every: int, warmup_steps: int = 0,
                 **all_reduce: Any) -> None:
        super().__init__(comm, **all_reduce)
        self.sync_every, self.warmup_steps = sync_every, warmup_steps
        self.local_sgd: Any = None

    def setup(self, model: Any, make_optimizer: MakeOptimizer) -> None:
        super().setup(model, make_optimizer)
        self.local_sgd = LocalSGD(model, comm=self.comm, sync_every=self.sync_every,
                                  warmup_steps=self.warmup_steps, algorithm=self.algorithm,
                                  broadcast_initial=False)

    def step(self, batch: Batch) -> StepResult:
        if not self.local_sgd.local:
            result = super().step(batch)
            self.local_sgd.step()  # counts the warmup step; no communication
            return result
        self.optimizer.lr = batch.lr
        result = StepResult()
        start = time.perf_counter()
        with self.ddp.no_sync():
            backward_end = self.forward_backward(batch, result)
        self.optimizer.step()
        self.optimizer.zero_grad()
        stepped = time.perf_counter()
        averaged = self.local_sgd.step()
        end = time.perf_counter()
        result.compute_s = stepped - start
        result.spans.append(Span("optimizer step", backward_end, stepped))
        if averaged:
            result.comm_s = result.exposed_s = end - stepped
            result.spans.append(Span("average parameters", stepped, end, cat="communication"))
        return result

    def total_allreduce_bytes(self) -> int:
        return self.allreduce_bytes + allreduce_bytes(self.local_sgd.bytes_reduced, self.comm.size)


class DiLoCoStrategy(AllReduceStrategy):
    """DiLoCo (mpdl.parallel.diloco): every rank a worker taking inner steps on its own
    gradients; an outer Nesterov step on the averaged parameter change every `sync_every` steps,
    in `fragments` staggered fragments (Streaming DiLoCo, overlapped with the next step)."""

    mode = "diloco"

    def __init__(self, comm: Communicator, sync_every: int, outer_lr: float,
                 outer_momentum: float, fragments: int = 1, compress: str = "none",
                 **all_reduce: Any) -> None:
        super().__init__(comm, **all_reduce)
        self.outer = dict(sync_every=sync_every, outer_lr=outer_lr,
                          outer_momentum=outer_momentum, n_fragments=fragments, compress=compress)
        self.diloco: Any = None

    def setup(self, model: Any, make_optimizer: MakeOptimizer) -> None:
        super().setup(model, make_optimizer)  # DDP's construction broadcasts rank 0's model
        self.diloco = DiLoCo(model, comm=self.comm, algorithm=self.algorithm, **self.outer)

    def step(self, batch: Batch) -> StepResult:
        self.optimizer.lr = batch.lr
        result = StepResult()
        start = time.perf_counter()
        with self.ddp.no_sync():
            backward_end = self.forward_backward(batch, result)
        self.optimizer.step()
        self.optimizer.zero_grad()
        stepped = time.perf_counter()
        syncs = self.diloco.syncs
        self.diloco.step()
        end = time.perf_counter()
        result.compute_s = stepped - start
        result.spans.append(Span("optimizer step", backward_end, stepped))
        if self.diloco.syncs > syncs or self.diloco.overlap:
            result.comm_s = result.exposed_s = end - stepped
            result.spans.append(Span("outer step", stepped, end, cat="communication"))
        return result

    def finish(self) -> bool:
        self.diloco.finish()
        return True

    def describe(self, final: bool = False) -> str:
        if final:
            return f"{self.diloco.syncs} outer steps, {self.total_allreduce_bytes()} bytes sent"
        d = self.diloco
        return (f"DiLoCo every {d.sync_every} steps, outer lr {d.outer_lr} momentum "
                f"{d.outer_momentum}, {len(d.fragments)} fragment(s), outer gradients "
                f"{d.compress}")

    def total_allreduce_bytes(self) -> int:
        return self.allreduce_bytes + self.diloco.allreduce_bytes


class ParameterServerStrategy(Strategy):
    """The last `servers` ranks hold the parameters in shards and run SGD on them; the others,
    the workers, push their gradient and pull the parameters each step (mpdl.parallel.ps):
    `mode` sync, ssp (at most `staleness` steps apart) or async.

    The servers run SGD with `momentum` when synchronous, at most 0.5 otherwise (stale gradients
    already act as momentum, Mitliagkas et al. 2016); `setup`'s make_optimizer is not used.
    """

    mode = "ps"

    def __init__(self, comm: Communicator, servers: int = 1, mode: str = "sync",
                 staleness: int | None = None, lr: float = 0.1, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        super().__init__(comm)
        self.servers, self.ps_mode, self.staleness = servers, mode, staleness
        self.workers = comm.size - servers
        self.lr, self.weight_decay = lr, weight_decay
        self.server_momentum = momentum if mode == "sync" else min(momentum, 0.5)
        self.ps: Any = None

    @property
    def trains(self) -> bool:
        return self.comm.rank < self.workers

    @property
    def data_comm(self) -> Communicator:
        return self.comm.sub(range(self.workers))

    def roles(self) -> list[tuple[str, int]]:
        return [("worker", self.workers), ("server", self.servers)]

    def setup(self, model: Any, make_optimizer: MakeOptimizer) -> None:
        self.model = model
        self.ps = ParameterServer(model, comm=self.comm, servers=self.servers, mode=self.ps_mode,
                                  staleness=self.staleness)
        # the node layout is looked up collectively over all ranks: now, while the servers take
        # part, not when the workers' collectives first ask for it
        self.comm.node_of_rank()

    def step(self, batch: Batch) -> StepResult:
        result = StepResult()
        start = time.perf_counter()
        backward_end = self.forward_backward(batch, result)
        share = len(batch.y) / batch.global_size
        # async and ssp apply each worker's mean gradient as a step of its own: the rate is
        # scaled by the worker's share of the global batch (twice it: stale gradients damp)
        lr = batch.lr if self.ps_mode == "sync" else 2 * batch.lr * share
        self.ps.push_pull(lr, weight=share)
        self.model.zero_grad()
        end = time.perf_counter()
        result.compute_s = backward_end - start
        result.comm_s = result.exposed_s = end - backward_end
        result.spans.append(Span("push/pull", backward_end, end, cat="communication"))
        return result

    def serve(self) -> None:
        self.ps.serve(lambda params: optim.SGD(params, lr=self.lr, momentum=self.server_momentum,
                                               weight_decay=self.weight_decay))

    def finish(self) -> bool:
        self.ps.close()  # every worker now holds the servers' final parameters
        return True

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("the parameter server's shards and momentum are not saved")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError("the parameter server's shards and momentum are not saved")

    def describe(self, final: bool = False) -> str:
        if final:
            stats = self.ps.stats
            return (f"# parameter server {stats['mode']}: {sum(stats['updates'])} updates on "
                    f"{stats['servers']} server(s); {format_histogram(stats['staleness'])}")
        bound = f" (staleness <= {self.staleness})" if self.ps_mode == "ssp" else ""
        return f"parameter server {self.ps_mode}{bound}, server momentum {self.server_momentum:g}"

    def report(self, final: bool = False) -> dict[str, Any]:
        fields: dict[str, Any] = {"algorithm": f"ps-{self.ps_mode}", "mode": self.mode}
        if not final:
            return {**fields, "workers": self.workers, "servers": self.servers,
                    "ps_mode": self.ps_mode}
        stats = self.ps.stats
        return {**fields, "ps_mode": stats["mode"], "servers": stats["servers"],
                "workers": stats["workers"], "staleness_bound": stats["staleness_bound"],
                "updates": stats["updates"], "worker_steps": stats["worker_steps"],
                "staleness": {str(k): v for k, v in stats["staleness"].items()}}
