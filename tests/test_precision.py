"""Mixed precision (bf16, fp16 with loss scaling) and gradient accumulation, on the in-process world."""

from __future__ import annotations

import types

import numpy as np
import pytest

from mpdl.autograd import amp, nn, optim
from mpdl.autograd import functional as F
from mpdl.autograd.tensor import Tensor
from mpdl.backend import bfloat16
from mpdl.models.gpt import GPT
from mpdl.parallel import DistributedSampler
from mpdl.parallel.data_parallel import AllReduceStrategy
from mpdl.parallel.strategy import Batch
from mpdl.parallel.zero import ZeroStrategy
from mpdl.threadworld import run_world
from mpdl.training import precision

N = 23


def gpt() -> GPT:
    return GPT(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16, seed=0)


def gpt_data(n: int = N):
    rng = np.random.default_rng(5)
    return rng.integers(0, 13, (n, 8)), rng.integers(0, 13, (n, 8))


def config(name: str, scale: float = amp.INITIAL_SCALE) -> types.SimpleNamespace:
    return types.SimpleNamespace(optim=types.SimpleNamespace(precision=name,
                                                             loss_scale_init=scale))


def adam(p):
    return optim.Adam(p, lr=1e-2)


# -- the pieces -----------------------------------------------------------------------------------------
def test_loss_scaler_follows_grad_scaler_rules():
    s = amp.LossScaler()
    assert (s.scale, amp.GROWTH_INTERVAL, amp.GROWTH_FACTOR, amp.BACKOFF_FACTOR) == \
        (65536.0, 2000, 2.0, 0.5)
    s.update(False)
    assert s.scale == 32768.0 and s.skipped_steps == 1
    for _ in range(1999):
        s.update(True)
    assert s.scale == 32768.0
    s.update(True)
    assert s.scale == 65536.0
    for _ in range(1000):
        s.update(True)
    s.update(False)  # an overflow restarts the count of clean steps
    for _ in range(1999):
        s.update(True)
    assert s.scale == 32768.0 and s.skipped_steps == 2 and s.backoffs == 2


def test_matmul_rounds_operands_and_result_to_16_bits():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 7)), rng.standard_normal((7, 3))
    for dtype in (bfloat16, np.dtype(np.float16)):
        got = amp.matmul(a.astype(np.float32), b.astype(dtype), dtype)
        exact = a.astype(dtype).astype(np.float64) @ b.astype(dtype).astype(np.float64)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, got.astype(dtype).astype(np.float32))  # 16-bit values
        eps = 2.0**-8 if dtype == bfloat16 else 2.0**-11
        assert np.all(np.abs(got - exact) <= eps * np.abs(exact) + 1e-6)


def test_bf16_gpt_gradients_are_close_to_float32_and_16_bit():
    x, y = gpt_data()
    ref = gpt()
    F.cross_entropy(ref(Tensor(x)), y).backward()
    m = gpt()
    precision.prepare(m, config("bf16"))
    F.cross_entropy(m(Tensor(x)), y).backward()
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert p.data.dtype == bfloat16 and p.grad.dtype == bfloat16
        scale = np.abs(q.grad).max() + 1e-12
        assert np.abs(p.grad.astype(np.float32) - q.grad).max() <= 0.08 * scale


def test_a_parameter_another_pipeline_stage_holds_stays_a_zero_byte_placeholder():
    m = gpt()
    dropped, kept = m.parameters()[:2]
    dropped.data = np.broadcast_to(np.full((), np.nan, np.float32), dropped.shape)
    precision.prepare(m, config("bf16"))
    assert dropped.data.dtype == bfloat16 and not any(dropped.data.strides)
    assert np.isnan(dropped.data.astype(np.float32)).all()
    assert kept.data.dtype == bfloat16 and kept.data.flags.owndata


def test_master_weights_are_float32_and_the_compute_copy_their_rounding():
    x, y = gpt_data()
    m = gpt()
    precision.prepare(m, config("bf16"))
    opt = precision.optimizer_factory(adam, config("bf16"))(m.parameters())
    for _ in range(3):
        F.cross_entropy(m(Tensor(x)), y).backward()
        opt.step()
        opt.zero_grad()
    for p in m.parameters():
        master = opt.state[p]["master"]
        assert master.dtype == np.float32 and opt.state[p]["exp_avg"].dtype == np.float32
        np.testing.assert_array_equal(p.data, master.astype(bfloat16))
    # updates smaller than half a bfloat16 ulp accumulate in the master weights
    assert any(not np.array_equal(opt.state[p]["master"], p.data.astype(np.float32))
               for p in m.parameters())


def test_fp16_overflow_skips_the_step_and_backs_off():
    x, y = gpt_data()
    m = gpt()
    precision.prepare(m, config("fp16"))
    opt = precision.optimizer_factory(adam, config("fp16", 2.0**40))(m.parameters())
    before = [p.data.copy() for p in m.parameters()]
    F.cross_entropy(m(Tensor(x)), y).backward(opt.loss_scale)
    assert not all(np.isfinite(p.grad).all() for p in m.parameters())
    opt.step()
    assert opt.skipped_steps == 1 and opt.loss_scale == 2.0**39
    for p, b in zip(m.parameters(), before, strict=True):
        np.testing.assert_array_equal(p.data, b)
    opt.scaler.scale = 1024.0  # a scale that fits: the unscaled step is taken
    opt.zero_grad()
    F.cross_entropy(m(Tensor(x)), y).backward(opt.loss_scale)
    opt.step()
    assert opt.skipped_steps == 1
    assert all(np.isfinite(p.data).all() for p in m.parameters())
    assert any(not np.array_equal(p.data, b) for p, b in zip(m.parameters(), before, strict=True))


# -- strategies ---------------------------------------------------------------------------------------------
def run(comm, make, name: str = "fp32", accum: int = 1, steps: int = 2, batch: int = 7,
        scale: float = amp.INITIAL_SCALE):
    """(whole parameters as float64, strategy) after `steps` steps of make(comm)."""
    m = gpt()
    x, y = gpt_data()
    precision.prepare(m, config(name))
    strategy = make(comm, accum)
    strategy.setup(m, precision.optimizer_factory(adam, config(name, scale)))
    sampler = DistributedSampler(N, batch, rank=comm.rank, num_replicas=comm.size, seed=1)
    for step, (idx, global_batch) in enumerate(sampler):
        if step == steps:
            break
        strategy.step(Batch(x[idx], y[idx], global_batch, 1e-2))
    with strategy.gathered():
        params = np.concatenate([p.data.astype(np.float64).ravel() for p in m.parameters()])
    return params, strategy


def ddp(comm, accum):
    return AllReduceStrategy(comm, bucket_mb=1e-3, first_bucket_mb=1e-3, grad_accum=accum)


@pytest.mark.parametrize("p,accum", [(1, 4), (2, 3), (3, 5)])
def test_grad_accumulation_equals_the_large_batch(p, accum):
    """N microbatches (some empty at p = 3: 7 samples over 3 ranks and 5 microbatches) give the
    step of the whole batch, within float32 rounding."""
    ref = run_world(1, lambda c: run(c, ddp))[0][0]
    out = run_world(p, lambda c: run(c, ddp, accum=accum))
    for params, _ in out:
        assert np.array_equal(params, out[0][0]), "ranks disagree"
        np.testing.assert_allclose(params, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_ddp_communicates_16_bit_gradients_and_replicas_stay_identical(name):
    ref = run_world(1, lambda c: run(c, ddp))[0][0]
    out = run_world(3, lambda c: run(c, ddp, name))
    for params, strategy in out:
        assert all(b.buffer.dtype.itemsize == 2 for b in strategy.ddp.buckets)
        assert np.array_equal(params, out[0][0]), "replicas drifted apart"
    assert np.abs(out[0][0] - ref).max() < 0.05  # two Adam steps of lr 1e-2 from the same start


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_shards_master_weights_and_agrees_on_skipping(stage):
    def zero(comm, accum):
        return ZeroStrategy(comm, stage, first_bucket_mb=1e-3, bucket_mb=2e-3)

    ddp_bf16 = run_world(1, lambda c: run(c, ddp, "bf16"))[0][0]
    out = run_world(3, lambda c: run(c, zero, "bf16"))
    for params, strategy in out:
        assert np.array_equal(params, out[0][0])
        pieces = sum(piece.tensor.data.size for piece in strategy.pieces)
        masters = sum(v.size for s in strategy.optimizer.state.values() for k, v in s.items()
                      if k == "master")
        assert masters == pieces < params.size  # each rank holds the master weights of its shard
    # Adam moves each weight by about lr whatever the gradient's size: a tiny gradient whose sign
    # a different 16-bit summation order flips moves it the other way (at most 2 lr a step)
    diff = np.abs(out[0][0] - ddp_bf16)
    assert np.median(diff) < 1e-3 and diff.max() <= 4 * 1e-2 + 1e-3
    skipped = run_world(3, lambda c: run(c, zero, "fp16", scale=2.0**40)[1].optimizer.scaler)
    assert [s.skipped_steps for s in skipped] == [2, 2, 2]  # every rank skipped both steps


def test_zero_bytes_follow_the_mixed_precision_formulas():
    """Mixed-precision Adam (K = 12) at p = 4: stage 1 4Ψ + 12Ψ/p, stage 2 2Ψ + 14Ψ/p, stage 3
    16Ψ/p bytes (Rajbhandari et al. 2020), plus the units in flight (small here)."""
    p = 4

    def deep(comm, stage):
        m = nn.Sequential(nn.Flatten(), nn.Linear(15, 16, seed=0),
                          *[layer for i in range(48) for layer in (nn.ReLU(),
                                                                  nn.Linear(16, 16, seed=i + 1))],
                          nn.ReLU(), nn.Linear(16, 10, seed=99))
        precision.prepare(m, config("bf16"))
        strategy = ZeroStrategy(comm, stage, first_bucket_mb=1e-3, bucket_mb=2e-3)
        strategy.setup(m, precision.optimizer_factory(adam, config("bf16")))
        x = np.random.default_rng(0).standard_normal((8, 1, 5, 3)).astype(np.float32)
        y = np.arange(8) % 10
        for _ in range(2):
            lo = comm.rank * 2
            strategy.step(Batch(x[lo:lo + 2], y[lo:lo + 2], 2 * comm.size, 1e-3))
        with strategy.gathered():
            pass
        return sum(q.data.size for q in m.parameters()), strategy.model_state_bytes

    for stage, formula in ((1, lambda psi: 4 * psi + 12 * psi / p),
                           (2, lambda psi: 2 * psi + 14 * psi / p),
                           (3, lambda psi: 16 * psi / p)):
        psi, measured = run_world(p, lambda c, s=stage: deep(c, s))[0]
        assert abs(measured - formula(psi)) <= 0.10 * formula(psi), (stage, measured, formula(psi))


def test_precision_dtypes_per_array_module():
    from mpdl.backend import precision_dtype, standin

    assert precision_dtype("bf16") == bfloat16 and precision_dtype("bf16", standin) == bfloat16
    assert precision_dtype("fp16") == np.float16 and precision_dtype("fp32") == np.float32
    no_bf16 = types.SimpleNamespace(__name__="cupy", __version__="13.0")
    with pytest.raises(TypeError, match="bf16 needs an array module with a bfloat16 type"):
        precision_dtype("bf16", no_bf16)
    with pytest.raises(ValueError, match="precision: expected one of fp32, bf16, fp16"):
        precision_dtype("fp8")
