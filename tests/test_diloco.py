"""DiLoCo on the in-process world: the outer step against PyTorch's Nesterov SGD and a NumPy
reference, the special cases (outer lr 1 without momentum is local SGD's averaging; one rank is
the inner optimizer alone), fragments, overlap and the compressed encodings."""

from __future__ import annotations

import io

import numpy as np
import pytest

from mpdl.autograd import nn
from mpdl.parallel.diloco import (
    QUANT_BLOCK,
    DiLoCo,
    dequantize,
    fragments,
    nesterov_step,
    quantize,
)
from mpdl.parallel.localsgd import LocalSGD
from mpdl.parallel.naive import NaiveDiLoCo
from mpdl.threadworld import run_world
from mpdl.training.config import TrainConfig
from mpdl.training.loop import Trainer


def make_model(seed: int = 0):
    return nn.Sequential(nn.Linear(5, 7, seed=seed), nn.ReLU(), nn.Linear(7, 3, seed=seed + 1))


def inner_step(model, rank: int, step: int) -> None:
    """A rank's own inner step: a deterministic, rank-dependent change of every parameter."""
    rng = np.random.default_rng(1000 * step + rank)
    for p in model.parameters():
        p.data -= (0.01 * rng.standard_normal(p.data.shape)).astype(p.data.dtype)


def params(model) -> np.ndarray:
    return np.concatenate([p.data.reshape(-1) for p in model.parameters()])


def trained(p: int, make_sync, steps: int) -> list[np.ndarray]:
    """Each rank's parameters after `steps` inner steps, `make_sync(model, comm).step()` after
    each."""
    def fn(comm):
        model = make_model()
        sync = make_sync(model, comm)
        for s in range(1, steps + 1):
            inner_step(model, comm.rank, s)
            sync.step()
        return params(model)
    return run_world(p, fn)


def test_outer_step_is_pytorch_nesterov_sgd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    theta = rng.standard_normal(11).astype(np.float32)
    momentum = np.zeros_like(theta)
    reference = torch.nn.Parameter(torch.tensor(theta.copy()))
    opt = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(5):
        delta = rng.standard_normal(11).astype(np.float32)
        nesterov_step(theta, delta, momentum, 0.7, 0.9)
        reference.grad = torch.tensor(delta)
        opt.step()
    np.testing.assert_allclose(theta, reference.detach().numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_outer_steps_match_a_numpy_reference(p):
    """Each rank's parameters after three outer steps (H = 4), against the formula applied to
    the locals every rank held before each synchronisation."""
    h, steps, lr, mu = 4, 12, 0.7, 0.9

    def fn(comm):
        model = make_model()
        diloco = DiLoCo(model, comm=comm, sync_every=h, outer_lr=lr, outer_momentum=mu,
                        algorithm="ring")
        before_sync = []
        for s in range(1, steps + 1):
            inner_step(model, comm.rank, s)
            if s % h == 0:
                before_sync.append(params(model).copy())
            diloco.step()
        return params(model), before_sync

    results = run_world(p, fn)
    global_ = params(make_model()).astype(np.float64)
    m = np.zeros_like(global_)
    for k in range(steps // h):
        delta = np.mean([global_ - r[1][k] for r in results], axis=0)
        m = mu * m + delta
        global_ = global_ - lr * (delta + mu * m)
    for final, _ in results:
        np.testing.assert_allclose(final, global_, rtol=1e-5, atol=1e-6)
        assert np.array_equal(final, results[0][0])


@pytest.mark.parametrize("p", [2, 3])
def test_outer_lr_one_without_momentum_is_local_sgd(p):
    ours = trained(p, lambda m, c: DiLoCo(m, comm=c, sync_every=3, outer_lr=1.0,
                                          outer_momentum=0.0), 9)
    local = trained(p, lambda m, c: LocalSGD(m, comm=c, sync_every=3), 9)
    for a, b in zip(ours, local, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fragments_, compress", [(1, "none"), (3, "none"), (3, "fp16")])
def test_one_rank_with_outer_lr_one_is_the_inner_optimizer_alone(fragments_, compress):
    def fn(comm):
        model, alone = make_model(), make_model()
        diloco = DiLoCo(model, comm=comm, sync_every=4, outer_lr=1.0, outer_momentum=0.0,
                        n_fragments=fragments_, compress=compress)
        for s in range(1, 11):
            inner_step(model, 0, s)
            inner_step(alone, 0, s)
            diloco.step()
        diloco.finish()
        return params(model), params(alone)

    ours, alone = run_world(1, fn)[0]
    np.testing.assert_allclose(ours, alone, rtol=0, atol=1e-5)


def test_naive_and_packed_diloco_agree():
    naive = trained(3, lambda m, c: NaiveDiLoCo(m, comm=c, sync_every=4, algorithm="ring"), 12)
    packed = trained(3, lambda m, c: DiLoCo(m, comm=c, sync_every=4, algorithm="ring"), 12)
    for a, b in zip(naive, packed, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("compress", ["none", "fp16", "int8", "int4"])
def test_streaming_fragments_sync_once_per_period_and_replicas_agree_at_the_end(p, compress):
    h, f, steps = 8, 4, 32

    def fn(comm):
        model = make_model()
        diloco = DiLoCo(model, comm=comm, sync_every=h, n_fragments=f, compress=compress)
        synced = []
        for s in range(1, steps + 1):
            inner_step(model, comm.rank, s)
            diloco.step()
            synced.append(diloco.syncs)
        diloco.finish()
        return params(model), synced, [frag.offset for frag in diloco.fragments]

    results = run_world(p, fn)
    final, synced, offsets = results[0]
    assert sorted(offsets) == [0, 2, 4, 6]
    for start in range(h, steps - h, h):  # each fragment once per period
        assert synced[start + h] - synced[start] == f
    for other, _, _ in results[1:]:
        assert np.array_equal(other, final)


def test_fragments_are_contiguous_balanced_and_never_empty():
    sizes = [400, 4, 400, 4, 400, 4, 400, 4]
    groups = fragments(sizes, 4)
    assert [i for g in groups for i in g] == list(range(8))
    assert all(g for g in groups)
    assert max(sum(sizes[i] for i in g) for g in groups) <= 404
    assert [len(g) for g in fragments([1, 1, 1], 3)] == [1, 1, 1]
    with pytest.raises(ValueError, match="fragments"):
        fragments([1, 1], 3)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [0, 1, 255, 256, 1001])
def test_quantize_round_trip_within_half_a_step(bits, n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    q, scale = quantize(x, bits)
    assert q.dtype == np.int8 and q.nbytes == -(-n // QUANT_BLOCK) * QUANT_BLOCK * bits // 8
    back = dequantize(q, scale, bits, n)
    step = np.repeat(scale, QUANT_BLOCK)[:n]
    assert np.all(np.abs(back - x) <= step / 2 + 1e-7)


def test_int4_codes_every_level_exactly():
    levels = np.tile(np.arange(-7, 8, dtype=np.float32), 18)[:QUANT_BLOCK]
    q, scale = quantize(levels, 4)
    assert scale[0] == 1.0
    assert np.array_equal(dequantize(q, scale, 4, levels.size), levels)


def test_error_feedback_carries_what_int4_lost():
    """With error feedback the outer gradients sent add up to those computed, within one
    quantisation step: nothing is lost for good."""
    def fn(comm):
        model = nn.Sequential(nn.Linear(64, 8, seed=0))
        diloco = DiLoCo(model, comm=comm, sync_every=1, outer_lr=1.0, outer_momentum=0.0,
                        compress="int4")
        start = params(model).copy()
        for s in range(1, 41):
            inner_step(model, 0, s)
            diloco.step()
        return params(model), start

    final, start = run_world(1, fn)[0]
    alone = nn.Sequential(nn.Linear(64, 8, seed=0))  # the same inner steps without DiLoCo
    for s in range(1, 41):
        inner_step(alone, 0, s)
    # only the last encoding's error remains (half a step of about 0.03 / 7); without the
    # feedback 40 such errors would add up
    assert np.abs(final - params(alone)).max() < 0.004


def test_bad_arguments():
    model = make_model()
    with pytest.raises(ValueError, match="compress"):
        DiLoCo(model, compress="int2")
    with pytest.raises(ValueError, match="sync_every"):
        DiLoCo(model, sync_every=0)


@pytest.mark.parametrize("p", [2, 3])
def test_allreduce_bytes_of_a_run_ddp_and_diloco(p):
    """The summary's allreduce_bytes: DDP sends 2(p-1)/p of the model's bytes each step, DiLoCo
    that once every H steps (8 steps of a tiny GPT, H = 4)."""
    tiny = {"model.name": "gpt", "data.dataset": "addition", "data.digits": 1,
            "model.n_layer": 1, "model.n_head": 2, "model.n_embd": 8,
            "optim.global_batch_size": 12, "optim.max_steps": 8, "optim.optimizer": "adamw",
            "output.progress": False}

    def sent(changes):
        def fn(comm):
            trainer = Trainer(TrainConfig.from_keys({**tiny, **changes}), comm=comm,
                              out=io.StringIO())
            trainer.setup()
            trainer.run()
            model_bytes = sum(q.data.nbytes for q in trainer.strategy.model.parameters())
            return trainer.strategy.report(final=True)["allreduce_bytes"], model_bytes
        return run_world(p, fn)

    ddp = sent({})
    diloco = sent({"communication.diloco": True, "communication.sync_every": 4})
    for (ddp_bytes, model_bytes), (diloco_bytes, _) in zip(ddp, diloco, strict=True):
        per_allreduce = 2 * (p - 1) * model_bytes // p
        assert ddp_bytes == 8 * per_allreduce
        assert diloco_bytes == 2 * per_allreduce
