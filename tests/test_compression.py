"""Gradient compression: round-trip error bounds, the error-feedback invariant, identical sums on
every rank, wire bytes, and training on digits with each compressor (p ranks of the in-process
world, gradients summed by GradientCompression.aggregate)."""

from __future__ import annotations

import numpy as np
import pytest

from mpdl.autograd import functional as F
from mpdl.autograd import nn
from mpdl.autograd.optim import SGD
from mpdl.autograd.tensor import Tensor
from mpdl.datasets import load_digits
from mpdl.parallel.compression import (
    COMPRESSORS,
    FP16Compressor,
    GradientCompression,
    NoCompression,
    PowerSGDCompressor,
    QSGDCompressor,
    SignSGDCompressor,
    StepInfo,
    TopKCompressor,
    make_compression,
    orthonormalise,
)
from mpdl.threadworld import run_world

RNG = np.random.default_rng(0)
X = RNG.standard_normal(1001).astype(np.float32)


def roundtrip(comp, x, step=0):
    payload, ctx = comp.compress(x, StepInfo(0, step, 0))
    return comp.decompress(payload, ctx), payload


def test_fp16_roundtrip_is_within_half_precision():
    y, payload = roundtrip(FP16Compressor(), X)
    assert payload[0].dtype == np.float16 and y.dtype == np.float32
    assert np.all(np.abs(y - X) <= np.abs(X) * 2.0**-11 + 1e-7)


@pytest.mark.parametrize("ratio", [0.01, 0.1, 1.0])
def test_topk_keeps_the_largest_values_exactly(ratio):
    y, (idx, vals) = roundtrip(TopKCompressor(ratio), X)
    k = int(np.ceil(ratio * X.size))
    assert idx.dtype == np.int32 and idx.size == k
    assert np.array_equal(y[idx], X[idx])
    assert np.count_nonzero(y) == k
    # everything dropped is no larger than the smallest value sent
    dropped = np.delete(np.abs(X), idx)
    assert dropped.size == 0 or dropped.max() <= np.abs(vals).min()
    assert np.linalg.norm(y - X) ** 2 <= (1 - k / X.size) * np.linalg.norm(X) ** 2 + 1e-6


def test_topk_sparsity_warmup_ramps_down_to_the_ratio():
    comp = TopKCompressor(0.01, warmup_steps=4)
    density = [comp.density(s) for s in range(6)]
    assert density[0] == pytest.approx(0.25)
    assert all(a > b for a, b in zip(density[:4], density[1:5], strict=True))
    assert density[4] == density[5] == 0.01


@pytest.mark.parametrize("levels", [1, 4, 127])
def test_qsgd_error_bound_and_payload(levels):
    comp = QSGDCompressor(levels, chunk=100)
    y, (q, norms) = roundtrip(comp, X)
    assert q.dtype == np.int8 and norms.dtype == np.float32 and norms.size == 11
    # each value is off by less than one quantisation step of its chunk
    step = np.repeat(norms / levels, 100)[:X.size]
    assert np.all(np.abs(y - X) <= step * (1 + 1e-5))
    assert np.all(np.abs(q) <= levels)


def test_qsgd_is_unbiased_and_reproducible():
    comp = QSGDCompressor(2, chunk=64)
    x = X[:64]
    mean = np.mean([roundtrip(comp, x, step)[0] for step in range(3000)], axis=0)
    norm = np.linalg.norm(x)
    assert np.abs(mean - x).max() < 0.05 * norm
    assert np.array_equal(roundtrip(comp, x, 5)[0], roundtrip(comp, x, 5)[0])
    assert not np.array_equal(roundtrip(comp, x, 5)[0], roundtrip(comp, x, 6)[0])


def test_signsgd_is_one_bit_per_value_and_scaled():
    y, (bits, scale) = roundtrip(SignSGDCompressor(), X)
    assert bits.dtype == np.uint8 and bits.size == -(-X.size // 8)
    assert scale[0] == pytest.approx(np.abs(X).mean())
    comp = SignSGDCompressor()
    payload, ctx = comp.compress(X, StepInfo(sizes=(1000, 1)))
    assert payload[1].tolist() == pytest.approx([np.abs(X[:1000]).mean(), abs(X[1000])])
    assert np.array_equal(np.sign(y), np.where(X >= 0, 1, -1))
    # the scaled sign is the best multiple of sign(x) in the l1 sense: error below ‖x‖
    assert np.linalg.norm(y - X) <= np.linalg.norm(X)


def test_powersgd_is_exact_for_low_rank_matrices_after_warm_start():
    a = RNG.standard_normal((30, 2)) @ RNG.standard_normal((2, 40))
    m = a.astype(np.float64).reshape(-1)
    gc = GradientCompression(PowerSGDCompressor(rank=2), error_feedback=False)
    run_world(1, lambda comm: gc.aggregate(m, comm, shapes=[(30, 40)]))
    y = run_world(1, lambda comm: gc.aggregate(m, comm, shapes=[(30, 40)]))[0]
    assert np.allclose(y, m, atol=1e-8)
    assert gc.last_wire_bytes == (30 + 40) * 2 * 8


def test_powersgd_layout_sends_vectors_dense():
    comp = PowerSGDCompressor(rank=2)
    layout = comp.layout(64 * 32 + 32 + 4, [(64, 32), (32,), (2, 2)])
    assert layout == [(0, 2048, 64, 32), (2048, 32), (2080, 4)]
    with pytest.raises(ValueError, match="shapes"):
        comp.layout(10, [(3, 3)])


def test_orthonormalise():
    q = orthonormalise(RNG.standard_normal((20, 3)))
    assert np.allclose(q.T @ q, np.eye(3), atol=1e-10)


@pytest.mark.parametrize("name", ["topk", "signsgd", "powersgd", "qsgd"])
def test_error_feedback_invariant(name):
    """Σ sent = Σ gradients − residual, whatever the compressor drops."""
    gc = make_compression(name, ratio=0.05, levels=4, rank=1, error_feedback=True)
    grads, sent = [], []
    for _ in range(7):
        g = RNG.standard_normal(300).astype(np.float64)
        grads.append(g)
        sent.append(run_world(1, lambda comm: gc.aggregate(g, comm, key="w"))[0])
    residual = gc.memory.residual("w")
    assert np.allclose(np.sum(sent, axis=0), np.sum(grads, axis=0) - residual, atol=1e-10)
    assert np.linalg.norm(residual) > 0


def test_dgc_momentum_correction_accumulates_velocity():
    gc = make_compression("topk", ratio=0.1, momentum=0.9)
    grads, velocity, sent = [], np.zeros(200), []
    for _ in range(5):
        g = RNG.standard_normal(200)
        grads.append(g)
        sent.append(run_world(1, lambda comm: gc.aggregate(g, comm, key=0))[0])
    # with momentum-factor masking, velocity restarts where a value was sent; the sum of what was
    # sent still equals the sum of the accumulated velocities minus the residual
    total_u = np.zeros(200)
    velocity = np.zeros(200)
    for g, s in zip(grads, sent, strict=True):
        velocity = 0.9 * velocity + g
        total_u += velocity
        velocity[s != 0] = 0
    assert np.allclose(np.sum(sent, axis=0), total_u - gc.memory.residual(0), atol=1e-10)


@pytest.mark.parametrize("name", COMPRESSORS[1:])
@pytest.mark.parametrize("p", [1, 3, 4])
def test_aggregate_is_bit_identical_and_sums_what_is_sent(name, p):
    size, carry = 777, 777 - 21 * 37
    comps = [make_compression(name, ratio=0.1, levels=16, rank=2) for _ in range(p)]

    def fn(comm):
        gc = comps[comm.rank]
        out = []
        for step in range(3):
            g = np.random.default_rng([comm.rank, step]).standard_normal(size).astype(np.float32)
            out.append(gc.aggregate(g, comm, key=0, shapes=[(21, 37), (carry,)]))
        return out

    results = run_world(p, fn)
    for step in range(3):
        assert all(np.array_equal(r[step], results[0][step]) for r in results), "ranks differ"
    assert results[0][0].dtype == np.float32 and results[0][0].shape == (size,)
    dense = 777 * 4
    assert comps[0].last_dense_bytes == dense
    expected = {"fp16": dense // 2, "topk": 78 * 8, "qsgd": 777 + 2 * 4, "signsgd": 98 + 4 * 2,
                "powersgd": (21 + 37) * 2 * 4}[name]
    assert comps[0].last_wire_bytes == expected


@pytest.mark.parametrize("name", ["fp16", "qsgd"])
def test_unbiased_compressors_sum_close_to_the_exact_sum(name):
    p = 4
    comps = [make_compression(name, levels=127) for _ in range(p)]
    grads = [np.random.default_rng(r).standard_normal(500) for r in range(p)]
    out = run_world(p, lambda comm: comps[comm.rank].aggregate(grads[comm.rank].astype(np.float32),
                                                               comm))[0]
    exact = np.sum(grads, axis=0)
    # QSGD's variance grows like sqrt(chunk)/s: within 15 % at 127 levels
    assert np.linalg.norm(out - exact) < 0.15 * np.linalg.norm(exact)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="compression: expected one of"):
        make_compression("zip")
    with pytest.raises(ValueError, match="ratio"):
        make_compression("topk", ratio=0)
    with pytest.raises(ValueError, match="levels"):
        make_compression("qsgd", levels=200)
    with pytest.raises(ValueError, match="rank"):
        make_compression("powersgd", rank=0)
    with pytest.raises(ValueError, match="momentum"):
        GradientCompression(QSGDCompressor(), momentum=0.9)
    assert make_compression("none") is None
    with pytest.raises(TypeError, match="floating-point"):
        GradientCompression(NoCompression()).aggregate(np.arange(4))


# -- training ---------------------------------------------------------------------------------------
DIGITS = load_digits(seed=0)


def train_digits(name: str, p: int = 2, epochs: int = 20, batch: int = 64) -> float:
    """Data-parallel SGD on digits over p in-process ranks; returns rank 0's test accuracy.

    topk runs DGC's recipe (the momentum moves into the compressor's momentum correction);
    signsgd runs without momentum (scaled signs with momentum overshoot at this learning rate).
    """
    xtr, ytr, xte, yte = DIGITS
    momentum = 0.9 if name == "topk" else 0.0
    opt_momentum = 0.0 if name in ("topk", "signsgd") else 0.9

    def fn(comm):
        model = nn.Sequential(nn.Linear(64, 64, seed=1), nn.ReLU(), nn.Linear(64, 10, seed=2))
        params = model.parameters()
        gc = make_compression(name, ratio=0.05, levels=8, rank=2, momentum=momentum,
                              warmup_steps=20) if name != "none" else GradientCompression(
                                  NoCompression())
        opt = SGD(params, lr=0.3, momentum=opt_momentum)
        shapes = [p_.shape for p_ in params]
        order = np.random.default_rng(0)
        for _ in range(epochs):
            perm = order.permutation(len(xtr))
            for start in range(0, len(perm) - batch + 1, batch):
                idx = perm[start:start + batch][comm.rank::p]
                F.cross_entropy(model(Tensor(xtr[idx])), ytr[idx]).backward()
                flat = np.concatenate([q.grad.reshape(-1) for q in params]) / np.float32(p)
                total = gc.aggregate(flat, comm, key=0, shapes=shapes)
                pos = 0
                for q in params:
                    q.grad = total[pos:pos + q.size].reshape(q.shape)
                    pos += q.size
                opt.step()
                opt.zero_grad()
        acc = float((model(Tensor(xte)).data.argmax(1) == yte).mean())
        return acc, np.concatenate([q.data.reshape(-1) for q in params])

    results = run_world(p, fn)
    assert all(np.array_equal(r[1], results[0][1]) for r in results), "replicas drifted apart"
    return results[0][0]


@pytest.mark.parametrize("name", COMPRESSORS)
def test_training_with_each_compressor_reaches_93_percent_on_digits(name):
    acc = train_digits(name)
    assert acc >= 0.93, f"{name}: test accuracy {acc:.3f}"


@pytest.mark.parametrize("name", ["fp16", "topk", "qsgd", "signsgd", "powersgd"])
def test_ddp_with_compression_keeps_replicas_identical(name):
    from mpdl.parallel import DistributedDataParallel  # noqa: PLC0415

    xtr, ytr = DIGITS[0][:256], DIGITS[1][:256]

    def fn(comm):
        model = nn.Sequential(nn.Linear(64, 32, seed=comm.rank), nn.ReLU(),
                              nn.Linear(32, 10, seed=comm.rank + 7))
        ddp = DistributedDataParallel(model, comm=comm, compression=name, first_bucket_mb=1e-3,
                                      bucket_mb=4e-3)
        opt = SGD(model.parameters(), lr=0.2)
        losses = []
        for step in range(8):
            idx = np.arange(step * 32, step * 32 + 32)[comm.rank::comm.size]
            loss = F.cross_entropy(ddp(Tensor(xtr[idx])), ytr[idx])
            loss.backward()
            ddp.finish()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.item()))
        assert len(ddp.buckets) > 1 and ddp.compression.wire_bytes < ddp.compression.dense_bytes
        return np.concatenate([q.data.reshape(-1) for q in model.parameters()])

    results = run_world(3, fn)
    assert all(np.array_equal(r, results[0]) for r in results)


def test_ddp_rejects_unknown_compression():
    from mpdl.parallel import DistributedDataParallel  # noqa: PLC0415

    model = nn.Sequential(nn.Linear(2, 2, seed=0))
    with pytest.raises(ValueError, match="compression: expected one of"):
        run_world(1, lambda comm: DistributedDataParallel(model, comm=comm, compression="gzip"))
