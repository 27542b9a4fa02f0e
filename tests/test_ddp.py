"""DistributedDataParallel and DistributedSampler on the in-process world of p threads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from mpdl.autograd import functional as F
from mpdl.autograd import nn
from mpdl.autograd.optim import SGD
from mpdl.autograd.tensor import Tensor
from mpdl.collectives import algorithms
from mpdl.parallel import DistributedDataParallel, DistributedSampler, split_bounds
from mpdl.threadworld import run_world

RNG = np.random.default_rng(0)
X = RNG.standard_normal((40, 6))
Y = RNG.integers(0, 3, 40)


def mlp(seed: int, dtype=np.float64) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8, seed=seed, dtype=dtype), nn.ReLU(),
                         nn.Linear(8, 8, seed=seed + 1, dtype=dtype), nn.ReLU(),
                         nn.Linear(8, 3, seed=seed + 2, dtype=dtype))


def flat(model: nn.Module) -> np.ndarray:
    return np.concatenate([p.data.ravel() for p in model.parameters()])


def train(comm, p: int, B: int = 11, dtype=np.float64, algorithm: str = "ring",
          overlap: bool = True, epochs: int = 2) -> np.ndarray:
    """SGD with momentum on X, Y; comm=None is the single-process reference."""
    rank = comm.rank if comm is not None else 0
    model = mlp(10 * rank + 1, dtype)  # different on every rank: DDP must broadcast rank 0's
    if comm is None:
        model = mlp(1, dtype)
    ddp = None
    if comm is not None:
        ddp = DistributedDataParallel(model, comm=comm, algorithm=algorithm, overlap=overlap,
                                      first_bucket_mb=1e-4, bucket_mb=4e-4)
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = DistributedSampler(len(X), B, rank=rank, num_replicas=p, seed=5)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for idx, global_batch in sampler:
            if ddp is not None:
                ddp.set_local_batch(len(idx), global_batch)
            if len(idx):
                F.cross_entropy(model(Tensor(X[idx].astype(dtype))), Y[idx]).backward()
            if ddp is not None:
                ddp.finish()
            opt.step()
            opt.zero_grad()
    return flat(model)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
# the MPI library's own all-reduce needs real MPI: tests/mpi/test_ddp.py covers it
@pytest.mark.parametrize("algorithm", ["auto", *(a for a in algorithms("allreduce") if a != "mpi")])
def test_p_ranks_follow_one_rank(p, algorithm):
    reference = train(None, 1)
    results = run_world(p, lambda c: train(c, p, algorithm=algorithm))
    for r in results:
        np.testing.assert_allclose(r, reference, rtol=0, atol=1e-10)
    assert all(np.array_equal(r, results[0]) for r in results)


def test_float32_and_no_overlap_agree_with_reference():
    reference = train(None, 1, dtype=np.float32)
    for overlap in (True, False):
        results = run_world(3, lambda c: train(c, 3, dtype=np.float32, overlap=overlap))
        for r in results:
            np.testing.assert_allclose(r, reference, rtol=0, atol=1e-5)


def test_buckets_in_reverse_order_with_small_first_bucket():
    model = mlp(0, np.float32)
    names = {id(p): n for n, p in model.named_parameters()}

    def build(comm):
        ddp = DistributedDataParallel(model if comm.rank == 0 else mlp(0, np.float32), comm=comm,
                                      first_bucket_mb=120 / 2**20, bucket_mb=300 / 2**20)
        return [[names.get(id(p)) for p in b.params] for b in ddp.buckets] if comm.rank == 0 \
            else None

    layout = run_world(2, build)[0]
    # float32 bytes: 4.bias 12, 4.weight 96 | 2.bias 32, 2.weight 256 | 0.bias 32, 0.weight 192
    assert layout == [["4.bias", "4.weight"], ["2.bias", "2.weight"], ["0.bias", "0.weight"]]


@pytest.mark.parametrize("p", [2, 3])
def test_buckets_lie_in_shared_memory_and_shm_sums_them_where_they_lie(p, monkeypatch):
    """On one node with shm (or auto), each bucket is a shared array of the node and the shm
    all-reduce sums it where it lies (its copying path through the node's window never runs);
    training still follows one rank. With another algorithm the buckets are ordinary arrays."""
    from mpdl.collectives import shm  # noqa: PLC0415

    def copying(*args):
        raise AssertionError("the shm all-reduce copied a shared bucket through the window")

    monkeypatch.setattr(shm, "_allreduce_chunk", copying)
    reference = train(None, 1)
    results = run_world(p, lambda c: train(c, p, algorithm="shm"))
    for r in results:
        np.testing.assert_allclose(r, reference, rtol=0, atol=1e-10)
    assert all(np.array_equal(r, results[0]) for r in results)

    def placement(comm, algorithm):
        model = mlp(0)
        ddp = DistributedDataParallel(model, comm=comm, algorithm=algorithm,
                                      first_bucket_mb=1e-4, bucket_mb=4e-4)
        F.cross_entropy(model(Tensor(X[:4])), Y[:4]).backward()
        ddp.finish()
        return ({shm.in_shared_memory(comm, b.buffer) for b in ddp.buckets}, len(ddp.buckets),
                ddp.model_state_bytes())

    # the gradients are views of the buckets wherever these lie: held once
    held = 2 * sum(p.data.nbytes for p in mlp(0).parameters())
    for algorithm, shared in (("shm", True), ("auto", True), ("ring", False)):
        assert run_world(p, lambda c, a=algorithm: placement(c, a)) == [({shared}, 5, held)] * p


def test_model_mismatch_is_a_clear_error_on_every_rank():
    def build(comm):
        model = mlp(0) if comm.rank == 0 else nn.Sequential(nn.Linear(6, 9, seed=0))
        with pytest.raises(ValueError, match=r"differs between ranks.*'0.weight'.*rank 1"):
            DistributedDataParallel(model, comm=comm)
        return True

    assert run_world(2, build) == [True, True]


def test_bad_arguments():
    with pytest.raises(ValueError, match="algorithm"):
        DistributedDataParallel(mlp(0), algorithm="nonsense")
    with pytest.raises(ValueError, match="bucket_mb"):
        run_world(1, lambda c: DistributedDataParallel(mlp(0), comm=c, bucket_mb=0))


def test_no_sync_accumulates_and_matches_the_big_batch():
    """Two micro-batches under no_sync + one synchronised == one step on their union."""
    def step(comm, accumulate: bool):
        model = mlp(3)
        ddp = DistributedDataParallel(model, comm=comm)
        lo, hi = comm.rank * 8, comm.rank * 8 + 8
        if accumulate:
            with ddp.no_sync():
                F.cross_entropy(model(Tensor(X[lo:lo + 4])), Y[lo:lo + 4]).backward()
            F.cross_entropy(model(Tensor(X[lo + 4:hi])), Y[lo + 4:hi]).backward()
            ddp.finish()
            return [p.grad / 2 for p in model.parameters()]
        F.cross_entropy(model(Tensor(X[lo:hi])), Y[lo:hi]).backward()
        ddp.finish()
        return [p.grad for p in model.parameters()]

    accumulated = run_world(2, lambda c: step(c, True))
    direct = run_world(2, lambda c: step(c, False))
    for a, d in zip(accumulated[0], direct[0], strict=True):
        np.testing.assert_allclose(a, d, atol=1e-12)


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 4, seed=0, dtype=np.float64)
        self.a = nn.Linear(4, 3, seed=1, dtype=np.float64)
        self.b = nn.Linear(4, 3, seed=2, dtype=np.float64)
        self.use_b = False

    def forward(self, x):
        h = self.body(x).relu()
        return self.b(h) if self.use_b else self.a(h)


def test_unused_parameters_get_zeros_and_nobody_hangs():
    """Rank 1 uses head b, rank 0 head a: each head's gradient is its user's alone / p."""
    def step(comm):
        model = TwoHeads()
        model.use_b = comm.rank == 1
        local = dict.fromkeys(n for n, _ in model.named_parameters())
        for n, p in model.named_parameters():  # before DDP's hooks: the local gradient
            p.register_grad_ready_hook(lambda p, n=n: local.update({n: p.grad.copy()}))
        ddp = DistributedDataParallel(model, comm=comm, first_bucket_mb=1e-5, bucket_mb=1e-5)
        F.cross_entropy(model(Tensor(X[:4])), Y[:4]).backward()
        ddp.finish()
        return local, {n: p.grad for n, p in model.named_parameters()}

    (l0, g0), (l1, g1) = run_world(2, step)
    np.testing.assert_allclose(g0["a.weight"], l0["a.weight"] / 2)
    np.testing.assert_allclose(g0["b.weight"], l1["b.weight"] / 2)
    np.testing.assert_array_equal(g0["a.weight"], g1["a.weight"])
    assert l1["a.weight"] is None and l0["b.weight"] is None


def test_empty_slice_contributes_zero():
    """A rank with no samples (B < p at the end of an epoch) only runs finish()."""
    def step(comm):
        model = mlp(0)
        ddp = DistributedDataParallel(model, comm=comm)
        n = 3 if comm.rank == 0 else 0
        ddp.set_local_batch(n, 3)
        if n:
            F.cross_entropy(model(Tensor(X[:3])), Y[:3]).backward()
        ddp.finish()
        return [p.grad for p in model.parameters()]

    ref = mlp(0)
    F.cross_entropy(ref(Tensor(X[:3])), Y[:3]).backward()
    for got in run_world(3, step):
        for g, p in zip(got, ref.parameters(), strict=True):
            np.testing.assert_allclose(g, p.grad, atol=1e-12)


def test_second_backward_without_finish_is_an_error():
    def step(comm):
        model = mlp(0)
        DistributedDataParallel(model, comm=comm)
        F.cross_entropy(model(Tensor(X[:3])), Y[:3]).backward()
        with pytest.raises(RuntimeError, match="finish"):
            F.cross_entropy(model(Tensor(X[:3])), Y[:3]).backward()
        return True

    assert run_world(1, step) == [True]


def test_overlap_is_real_a_bucket_completes_while_backward_runs():
    """The first layer's gradient comes last in backward. A hook on it waits until the last
    layer's bucket has been all-reduced: only possible if that all-reduce runs during backward."""
    def step(comm):
        model = mlp(0)
        ddp = DistributedDataParallel(model, comm=comm, first_bucket_mb=1e-5, bucket_mb=1e-5)
        seen = {}

        def wait_for_first_bucket(_):
            handle = ddp.buckets[0].handle
            done = threading.Event()
            seen["launched"] = handle is not None
            if handle is not None:
                waiter = threading.Thread(target=lambda: (handle.wait(), done.set()), daemon=True)
                waiter.start()
                seen["done_during_backward"] = done.wait(20)

        model.parameters()[0].register_grad_ready_hook(wait_for_first_bucket)
        F.cross_entropy(model(Tensor(X[:4])), Y[:4]).backward()
        ddp.finish()
        return seen

    for seen in run_world(3, step):
        assert seen == {"launched": True, "done_during_backward": True}


def test_without_overlap_nothing_starts_before_finish():
    def step(comm):
        model = mlp(0)
        ddp = DistributedDataParallel(model, comm=comm, overlap=False)
        F.cross_entropy(model(Tensor(X[:4])), Y[:4]).backward()
        launched = [b.handle is not None for b in ddp.buckets]
        ddp.finish()
        return launched, ddp.last_comm_s >= 0

    assert run_world(2, step) == [([False], True)] * 2


@pytest.mark.parametrize("local, cores, nodes, overlapped", [
    (2, 2, 1, False), (3, 2, 1, False), (2, 4, 1, True), (None, 2, 1, True), (2, 2, 2, True)])
def test_overlap_only_where_it_can_pay(local, cores, nodes, overlapped, monkeypatch):
    """One node with no core to spare for the communication thread: every bucket is reduced in
    finish(), none during backward. With a spare core, a launcher that does not say, or the ranks
    on two nodes (waiting to hide), buckets but the last start during backward. The sums agree."""
    from mpdl import mpi_runtime

    monkeypatch.setattr(mpi_runtime, "launcher_local_size", lambda: local)
    monkeypatch.setattr(mpi_runtime, "usable_cores", lambda: cores)

    def step(comm):
        model = mlp(0)
        ddp = DistributedDataParallel(model, comm=comm, first_bucket_mb=1e-5, bucket_mb=1e-5)
        F.cross_entropy(model(Tensor(X[:4])), Y[:4]).backward()
        launched = [b.handle is not None for b in ddp.buckets]
        ddp.finish()
        return ddp.overlap, launched, [p.grad.copy() for p in model.parameters()]

    results = run_world(2, step, ranks_per_node=2 // nodes)
    for on, launched, grads in results:
        assert on is overlapped
        assert launched == [overlapped] * (len(launched) - 1) + [False]
        for g, want in zip(grads, results[0][2], strict=True):
            np.testing.assert_array_equal(g, want)


def test_the_last_bucket_is_reduced_in_finish_on_the_calling_thread():
    """With overlap, every bucket but the last is handed to the communication thread during
    backward; the last (full only when backward ends) is reduced by finish() itself, after the
    others, and the sums are right."""
    def step(comm):
        model = mlp(0)
        ddp = DistributedDataParallel(model, comm=comm, first_bucket_mb=1e-5, bucket_mb=1e-5)
        ran_on = {}
        reduce = ddp._reduce

        def spy(bucket):
            ran_on[bucket.index] = threading.current_thread()
            reduce(bucket)

        ddp._reduce = spy
        ddp.set_local_batch(2, 4)
        F.cross_entropy(model(Tensor(X[2 * comm.rank:2 * comm.rank + 2])),
                        Y[2 * comm.rank:2 * comm.rank + 2]).backward()
        launched = [b.handle is not None for b in ddp.buckets]
        ddp.finish()
        me = threading.current_thread()
        spans = [span for _, *span in ddp.bucket_spans()]
        return (launched, [ran_on[i] is me for i in range(len(ddp.buckets))], spans,
                [p.grad.copy() for p in model.parameters()])

    ref = mlp(0)
    F.cross_entropy(ref(Tensor(X[:4])), Y[:4]).backward()
    for launched, here, spans, grads in run_world(2, step):
        n = len(launched)
        assert n == 6 and launched == [True] * (n - 1) + [False]
        assert here == [False] * (n - 1) + [True]
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), "buckets ran out of order"
        for g, p in zip(grads, ref.parameters(), strict=True):
            np.testing.assert_allclose(g, p.grad, atol=1e-12)


def test_hook_time_and_ready_times_are_reported():
    def step(comm):
        model = mlp(0)
        ddp = DistributedDataParallel(model, comm=comm, first_bucket_mb=1e-5, bucket_mb=1e-5)
        loss = F.cross_entropy(model(Tensor(X[:4])), Y[:4])
        start = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        ddp.finish()
        return ddp.last_hook_s, ddp.bucket_ready_times(), start, end

    for hooks, ready, start, end in run_world(2, step):
        assert 0 < hooks < end - start
        assert len(ready) == 6 and all(start < r < end for r in ready)


def test_broadcasts_buffers_from_rank_0():
    def build(comm):
        model = nn.Sequential(nn.Linear(6, 4, seed=comm.rank), nn.BatchNorm1d(4))
        model[1].running_mean.data[...] = comm.rank + 1.0
        DistributedDataParallel(model, comm=comm)
        return model.state_dict()

    states = run_world(3, build)
    for s in states[1:]:
        for k in s:
            np.testing.assert_array_equal(s[k], states[0][k])
    assert (states[2]["1.running_mean"] == 1.0).all()


# ---------------------------------------------------------------------- sampler
def test_split_rule_first_ranks_get_one_more():
    assert split_bounds(10, 4) == [0, 3, 6, 8, 10]
    assert split_bounds(2, 4) == [0, 1, 2, 2, 2]
    assert split_bounds(8, 4) == [0, 2, 4, 6, 8]


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_sampler_slices_concatenate_to_the_one_rank_order(p):
    one = DistributedSampler(23, 7, seed=4)
    many = [DistributedSampler(23, 7, rank=r, num_replicas=p, seed=4) for r in range(p)]
    for epoch in range(3):
        one.set_epoch(epoch)
        for s in many:
            s.set_epoch(epoch)
        for (batch, size), *slices in zip(one, *many, strict=True):
            assert np.array_equal(np.concatenate([idx for idx, _ in slices]), batch)
            assert all(n == size for _, n in slices)
            assert [len(idx) for idx, _ in slices] == np.diff(split_bounds(size, p)).tolist()


def test_sampler_epochs_shuffle_differently_and_reproducibly():
    s = DistributedSampler(50, 10, seed=1)
    assert not np.array_equal(s.order(0), s.order(1))
    assert np.array_equal(s.order(1), DistributedSampler(50, 10, seed=1).order(1))
    assert np.array_equal(DistributedSampler(50, 10, shuffle=False).order(3), np.arange(50))


def test_sampler_drop_last_and_pad():
    keep = DistributedSampler(23, 10, seed=0)
    assert len(keep) == 3 and [n for _, n in keep] == [10, 10, 3]
    drop = DistributedSampler(23, 10, seed=0, drop_last=True)
    assert len(drop) == 2 and [n for _, n in drop] == [10, 10]
    pad = DistributedSampler(23, 10, seed=0, pad=True)
    batches = list(pad.global_batches())
    assert [len(b) for b in batches] == [10, 10, 10]
    assert np.array_equal(batches[2][3:], pad.order()[:7])


def test_sampler_state_round_trip_and_errors():
    s = DistributedSampler(30, 8, seed=9)
    s.set_epoch(4)
    t = DistributedSampler(30, 8, rank=1, num_replicas=3)
    t.load_state_dict(s.state_dict())
    assert t.epoch == 4 and t.seed == 9 and t.rank == 1
    with pytest.raises(ValueError, match="global_batch_size"):
        DistributedSampler(30, 9).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="rank"):
        DistributedSampler(30, 8, rank=3, num_replicas=3)
    with pytest.raises(ValueError, match="global_batch_size"):
        DistributedSampler(30, 0)
