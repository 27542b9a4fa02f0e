"""Muon: one step against a NumPy reference built on the SVD (the quintic acts on each singular
value on its own), the naive version against the optimizer on a GPT, and which parameters are
hidden matrices."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpdl.autograd import amp, nn, optim
from mpdl.autograd import functional as F
from mpdl.autograd.muon import NaiveMuon, is_hidden_matrix
from mpdl.autograd.tensor import Tensor
from mpdl.collectives.ops import block_bounds
from mpdl.models.gpt import GPT
from mpdl.parallel import DistributedSampler
from mpdl.parallel.data_parallel import AllReduceStrategy
from mpdl.parallel.owners import MatrixOwners, balanced_owners
from mpdl.parallel.shards import Unit, make_pieces
from mpdl.parallel.strategy import Batch
from mpdl.parallel.zero import ZeroStrategy
from mpdl.threadworld import run_world
from mpdl.training.config import ConfigError, TrainConfig, validate

LR, MU, WD, BETAS, EPS = 0.02, 0.95, 0.1, (0.9, 0.95), 1e-8


def reference_orthogonalize(u: np.ndarray) -> np.ndarray:
    """P·f⁵(Σ/‖U‖_F)·Qᵀ in float64, f(σ) = 3.4445σ - 4.7750σ³ + 2.0315σ⁵: what five quintic
    Newton-Schulz iterations do to U = PΣQᵀ."""
    p, sigma, qt = np.linalg.svd(u.astype(np.float64), full_matrices=False)
    s = sigma / np.sqrt((sigma**2).sum())
    for _ in range(5):
        s = 3.4445 * s - 4.7750 * s**3 + 2.0315 * s**5
    return (p * s) @ qt


def reference_steps(weights: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]],
                    hidden: set[str]) -> dict[str, np.ndarray]:
    """The weights after Muon's steps (hidden matrices) and AdamW's (the rest), in float64."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    buf = {k: np.zeros_like(v) for k, v in w.items()}
    m = {k: np.zeros_like(v) for k, v in w.items()}
    v2 = {k: np.zeros_like(v) for k, v in w.items()}
    for t, step in enumerate(grads, start=1):
        for k, g in step.items():
            if w[k].ndim == 2:
                w[k] = w[k] * (1 - LR * WD)
            if k in hidden:
                buf[k] = MU * buf[k] + g
                o = reference_orthogonalize(g + MU * buf[k])
                w[k] = w[k] - LR * 0.2 * math.sqrt(max(w[k].shape)) * o
            else:
                m[k] = BETAS[0] * m[k] + (1 - BETAS[0]) * g
                v2[k] = BETAS[1] * v2[k] + (1 - BETAS[1]) * g * g
                mhat, vhat = m[k] / (1 - BETAS[0]**t), v2[k] / (1 - BETAS[1]**t)
                w[k] = w[k] - LR * mhat / (np.sqrt(vhat) + EPS)
    return w


@pytest.mark.parametrize("make", [
    lambda ps: optim.Muon(ps, lr=LR, momentum=MU, betas=BETAS, eps=EPS, weight_decay=WD),
    lambda ps: NaiveMuon(ps, lr=LR, momentum=MU, betas=BETAS, eps=EPS, weight_decay=WD)],
    ids=["optim", "naive"])
def test_steps_follow_the_svd_reference(make):
    rng = np.random.default_rng(0)
    shapes = {"wide": (12, 20), "tall": (24, 8), "table": (10, 6), "bias": (7,)}
    weights = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    params = {k: (nn.TableParameter if k == "table" else nn.Parameter)(v.copy())
              for k, v in weights.items()}
    grads = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
             for _ in range(3)]
    opt = make(list(params.values()))
    for step in grads:
        for k, p in params.items():
            p.grad = step[k].copy()
        opt.step()
    want = reference_steps(weights, grads, hidden={"wide", "tall"})
    for k, p in params.items():
        moved = np.abs(want[k] - weights[k]).max()
        assert moved > 1e-2, k
        np.testing.assert_allclose(p.data, want[k], rtol=0, atol=2e-5 * max(1.0, moved), err_msg=k)


def test_the_quintic_leaves_singular_values_near_one():
    u = np.random.default_rng(1).standard_normal((32, 48)).astype(np.float32)
    spread = np.linalg.svd(u, compute_uv=False)
    assert spread.max() > 5 * spread.min()
    p = nn.Parameter(np.zeros_like(u))
    p.grad = u
    opt = optim.Muon([p], lr=1.0, momentum=0.0)
    opt.step()
    sigma = np.linalg.svd(-p.data / (0.2 * math.sqrt(48)), compute_uv=False)
    assert 0.5 < sigma.min() and sigma.max() < 1.5


def test_hidden_matrices_of_the_gpt():
    model = GPT(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16, seed=0)
    hidden = sorted(n for n, p in model.named_parameters() if is_hidden_matrix(p))
    assert hidden == sorted(f"blocks.{i}.{w}.weight" for i in range(2)
                            for w in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"))


def test_naive_and_optim_follow_each_other_on_a_gpt():
    def losses(make):
        model = GPT(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16, seed=3)
        opt = make(model.parameters())
        x = np.random.default_rng(4).integers(0, 11, (6, 8))
        out = []
        for _ in range(8):
            loss = F.cross_entropy(model(Tensor(x[:, :-1])), x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(float(loss.item()))
        return out

    naive = losses(lambda ps: NaiveMuon(ps, lr=1e-2, weight_decay=0.1))
    full = losses(lambda ps: optim.Muon(ps, lr=1e-2, weight_decay=0.1))
    assert naive[-1] < naive[0] - 0.3
    np.testing.assert_allclose(full, naive, rtol=1e-5)


def test_bad_momentum_is_named():
    with pytest.raises(ValueError, match="momentum"):
        optim.Muon([nn.Parameter(np.zeros((2, 2), np.float32))], momentum=1.0)


def test_owners_are_balanced_by_size():
    sizes = [100, 7, 64, 64, 3, 50, 50, 1]
    for ranks in (1, 2, 3, 5, 9):
        owners = balanced_owners(sizes, ranks)
        load = [sum(s for s, o in zip(sizes, owners, strict=True) if o == r)
                for r in range(ranks)]
        assert max(load) - min(load) <= max(sizes), (ranks, load)
        assert len(set(owners)) == min(ranks, len(sizes))


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_owners_apply_fn_to_whole_matrices(p):
    """Each rank's pieces come back as its pieces of fn(whole matrix), for a non-local fn."""
    rng = np.random.default_rng(p)
    whole = [nn.Parameter(rng.standard_normal(s).astype(np.float32))
             for s in [(5, 3), (7,), (4, 6), (1, 1), (3, 3)]]
    fn = lambda m: m @ m.T @ m + 1  # noqa: E731

    def run(comm):
        unit = Unit(0, whole, comm.rank, comm.size)
        unit.shard = np.concatenate([w.data.ravel() for w in whole])[unit.lo:unit.hi].copy()
        pieces, _ = make_pieces([unit])
        owners = MatrixOwners([unit], pieces, comm)
        parts = {id(pc.tensor): pc.tensor.data for pc in pieces if pc.end > pc.start}
        out = owners(parts, fn, lambda w: w.shape != (1, 1))
        got = {}
        for pc in pieces:
            if id(pc.tensor) in out:
                got[id(pc.param)] = (pc.in_param, out[id(pc.tensor)])
        return got, owners.sent_bytes

    results = run_world(p, run)
    # each matrix travels to its owner and back, less the block the owner holds (float32)
    matrices = [(o, w) for o, w in zip(np.cumsum([0] + [w.size for w in whole])[:-1], whole,
                                                  strict=True)
                if w.data.ndim == 2 and w.shape != (1, 1)]
    bounds = block_bounds(sum(w.size for w in whole), p)
    owner = balanced_owners([w.size for _, w in matrices], p)
    held = [max(0, min(bounds[r + 1], o + w.size) - max(bounds[r], o))
            for (o, w), r in zip(matrices, owner, strict=True)]
    assert sum(sent for _, sent in results) == sum(
        8 * (w.size - h) for (_, w), h in zip(matrices, held, strict=True))
    covered = {id(w): 0 for w in whole}
    for got, _ in results:
        for w in whole:
            if id(w) in got:
                where, value = got[id(w)]
                np.testing.assert_allclose(value, fn(w.data).ravel()[where], rtol=1e-5)
                covered[id(w)] += value.size
    assert [covered[id(w)] for w in whole] == [15, 0, 24, 0, 9]


def gpt_losses(comm, make_strategy, steps: int = 6):
    """Parameters (whole) and losses of `steps` Muon steps of a small GPT under the strategy."""
    model = GPT(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=10, seed=0,
                dtype=np.float64)
    rng = np.random.default_rng(5)
    x, y = rng.integers(0, 13, (14, 8)), rng.integers(0, 13, (14, 8))
    strategy = make_strategy(comm)
    strategy.setup(model, lambda ps: optim.Muon(ps, lr=2e-2, weight_decay=0.1))
    sampler = DistributedSampler(14, 7, rank=comm.rank, num_replicas=comm.size, seed=1)
    losses = []
    for epoch in range(steps // 2):
        sampler.set_epoch(epoch)
        for idx, global_batch in sampler:
            losses.append(strategy.step(Batch(x[idx], y[idx], global_batch,
                                              strategy.optimizer.lr)).loss)
    with strategy.gathered():
        params = np.concatenate([p.data.ravel().copy() for p in model.parameters()])
    return params, losses


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("p", [3, 4])
def test_zero_follows_one_rank(stage, p):
    ref, ref_losses = run_world(1, lambda c: gpt_losses(c, AllReduceStrategy))[0]
    assert ref_losses[-1] < ref_losses[0] - 0.2
    out = run_world(p, lambda c: gpt_losses(c, lambda comm: ZeroStrategy(
        comm, stage, first_bucket_mb=1e-3, bucket_mb=2e-3)))
    for params, _ in out:
        assert np.array_equal(params, out[0][0]), "ranks disagree"
    np.testing.assert_allclose(out[0][0], ref, rtol=0, atol=1e-6)


def test_mixed_precision_leaves_tables_to_adamw():
    rng = np.random.default_rng(2)
    table = nn.TableParameter(rng.standard_normal((6, 4)).astype(np.float16))
    weight = nn.Parameter(rng.standard_normal((5, 4)).astype(np.float16))
    opt = amp.MixedPrecisionOptimizer([table, weight], lambda ps: optim.Muon(ps, lr=1e-2))
    for p in (table, weight):
        p.grad = rng.standard_normal(p.shape).astype(np.float16)
    opt.step()
    assert "exp_avg" in opt.state[table] and "momentum_buffer" not in opt.state[table]
    assert "momentum_buffer" in opt.state[weight]


@pytest.mark.parametrize("flags, message", [
    ({"optim.deterministic": True, "parallel.zero": 1},
     r"optim\.deterministic cannot be combined with optim\.optimizer"),
    ({"parallel.zero": 1, "parallel.tp": 3, "model.name": "gpt"},
     r"optim\.optimizer muon with parallel\.tp cannot be combined with parallel\.zero"),
])
def test_config_errors(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(TrainConfig.from_keys({"optim.optimizer": "muon", **flags}), 3)
