"""ZeRO stages 1-3 on the in-process world (p up to 8): each stage must follow the trajectory of
DDP on one rank with the same global batch (the independent oracle), hold the model state the ZeRO
formulas give, and send the bytes counted from the message log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpdl.autograd import functional as F
from mpdl.autograd import nn, optim
from mpdl.autograd.tensor import Tensor
from mpdl.models.gpt import GPT
from mpdl.models.zoo import build_model
from mpdl.parallel import DistributedSampler
from mpdl.parallel.data_parallel import AllReduceStrategy
from mpdl.parallel.naive import NaiveZero
from mpdl.parallel.strategy import Batch
from mpdl.parallel.zero import ZeroStrategy
from mpdl.threadworld import run_world
from mpdl.training import checkpoint
from mpdl.training.config import ConfigError, TrainConfig, validate

TOL = {"float32": 1e-5, "float64": 1e-10}
OPTIMIZERS = {
    "sgd": lambda p: optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda p: optim.Adam(p, lr=1e-2),
    "adamw": lambda p: optim.AdamW(p, lr=1e-2),
    "lars": lambda p: optim.LARS(p, lr=0.5, momentum=0.9, weight_decay=1e-3),
    "lamb": lambda p: optim.LAMB(p, lr=1e-2, weight_decay=1e-2),
}
N = 23  # samples: with batch 7 the last batch has 2, fewer than most p (ranks without data)


def data(model: str, dtype: str):
    rng = np.random.default_rng(5)
    if model == "gpt":
        return rng.integers(0, 12, (N, 8)), rng.integers(0, 12, (N, 8))
    shape = (1, 28, 28) if model == "lenet" else (1, 5, 3)
    return rng.standard_normal((N, *shape)).astype(dtype), rng.integers(0, 10, N)


def make_model(model: str, dtype: str):
    if model == "gpt":  # 4 heads' worth of odd sizes: 2 blocks, vocabulary 13
        return GPT(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=10, seed=0,
                   dtype=np.dtype(dtype))
    shape = (1, 28, 28) if model == "lenet" else (1, 5, 3)
    if model == "mlp":  # 15·7+7 + 7·9+9 + 9·10+10 = 284 parameters: divides by none of 3..8
        return nn.Sequential(nn.Flatten(), nn.Linear(15, 7, seed=0, dtype=dtype), nn.ReLU(),
                             nn.Linear(7, 9, seed=1, dtype=dtype), nn.ReLU(),
                             nn.Linear(9, 10, seed=2, dtype=dtype))
    return build_model(model, shape, 10, seed=0, dtype=np.dtype(dtype))


def train(comm, make, model: str, opt: str, dtype: str, epochs: int = 1, batch: int = 7):
    """Parameters (whole) and per-step losses after `epochs` epochs of strategy make(comm)."""
    m = make_model(model, dtype)
    x, y = data(model, dtype)
    strategy = make(comm)
    strategy.setup(m, OPTIMIZERS[opt])
    sampler = DistributedSampler(N, batch, rank=comm.rank, num_replicas=comm.size, seed=1)
    losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for idx, global_batch in sampler:
            r = strategy.step(Batch(x[idx], y[idx], global_batch, strategy.optimizer.lr))
            losses.append(r.loss)
    with strategy.gathered():
        params = np.concatenate([p.data.ravel().copy() for p in m.parameters()])
    return params, losses, strategy


def reference(model: str, opt: str, dtype: str, **kw):
    return run_world(1, lambda c: train(c, AllReduceStrategy, model, opt, dtype, **kw))[0]


def zero(stage: int, **kw):
    return lambda comm: ZeroStrategy(comm, stage, first_bucket_mb=1e-3, bucket_mb=2e-3, **kw)


def check_same(p: int, make, model: str, opt: str, dtype: str, **kw) -> None:
    ref = reference(model, opt, dtype, **kw)[0]
    out = run_world(p, lambda c: train(c, make, model, opt, dtype, **kw))
    for params, _, _ in out:
        assert np.array_equal(params, out[0][0]), "ranks disagree"
    np.testing.assert_allclose(out[0][0], ref, rtol=0, atol=TOL[dtype])


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("p", [1, 3, 8])
def test_mlp_follows_ddp(stage, opt, p):
    check_same(p, zero(stage), "mlp", opt, "float64", epochs=2)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("opt", ["adamw", "lars", "lamb"])
def test_other_optimizers_follow_ddp(stage, opt):
    check_same(5, zero(stage), "mlp", opt, "float64")


@pytest.mark.parametrize("stage", [1, 3])
def test_pat_reduce_scatters_and_gathers_like_ddp(stage):
    check_same(5, zero(stage, algorithm="pat"), "mlp", "adam", "float64")


@pytest.mark.parametrize("stage", [1, 3])
def test_float32_and_no_prefetch(stage):
    check_same(4, zero(stage, prefetch=False), "mlp", "adam", "float32")
    check_same(6, zero(stage), "mlp", "sgd", "float32")


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_gpt_follows_ddp(stage, opt):
    check_same(3, zero(stage), "gpt", opt, "float64")


@pytest.mark.parametrize("stage", [2, 3])
def test_lenet_follows_ddp(stage):
    check_same(4, zero(stage), "lenet", "sgd", "float64", batch=11)


def test_naive_zero_matches_ddp():
    def naive(comm):
        m = make_model("mlp", "float64")
        x, y = data("mlp", "float64")
        z = NaiveZero(m, OPTIMIZERS["adam"], comm)
        for step in range(3):
            lo, hi = step * 6, step * 6 + 6
            bounds = np.linspace(lo, hi, comm.size + 1).astype(int)
            a, b = bounds[comm.rank], bounds[comm.rank + 1]
            z.weight = (b - a) / 6
            if b > a:
                F.cross_entropy(m(Tensor(x[a:b])), y[a:b]).backward()
            z.step()
        return np.concatenate([p.data.ravel() for p in m.parameters()])

    ref = run_world(1, naive)[0]
    for params in run_world(5, naive):
        np.testing.assert_allclose(params, ref, rtol=0, atol=1e-10)


def deep_mlp(width: int = 16, layers: int = 48) -> nn.Module:
    mods: list = [nn.Flatten(), nn.Linear(15, width, seed=0)]
    for i in range(layers):
        mods += [nn.ReLU(), nn.Linear(width, width, seed=i + 1)]
    return nn.Sequential(*mods, nn.ReLU(), nn.Linear(width, 10, seed=99))


def measure(comm, make):
    """(Ψ, strategy, bytes this rank sent in its two steps, from the message log if any)."""
    m = deep_mlp()
    x, y = data("mlp", "float32")
    strategy = make(comm)
    strategy.setup(m, OPTIMIZERS["adam"])
    log = comm.message_log if comm.message_log is not None else []
    comm.barrier()
    first = len(log)
    for step in range(2):
        lo = step * 8 + comm.rank * 2
        strategy.step(Batch(x[lo:lo + 2], y[lo:lo + 2], 2 * comm.size, 1e-3))
    comm.barrier()
    sent = sum(e[4] for e in log[first:] if e[2] == comm.rank and e[1] != "barrier")
    with strategy.gathered():
        pass
    return sum(p.data.size for p in m.parameters()), strategy, sent


def test_model_state_bytes_follow_the_formulas():
    """Adam in float32 at p = 4: stage 1 8Ψ + 8Ψ/p, stage 2 4Ψ + 12Ψ/p, stage 3 16Ψ/p bytes
    (plus what is in flight: the gathered units and gradient buffers, small here)."""
    p = 4
    for stage, formula in ((1, lambda psi: 8 * psi + 8 * psi / p),
                           (2, lambda psi: 4 * psi + 12 * psi / p),
                           (3, lambda psi: 16 * psi / p)):
        out = run_world(p, lambda c, s=stage: measure(c, zero(s)))
        psi, strategy, _ = out[0]
        measured = strategy.model_state_bytes
        assert measured == max(s.step_peak_bytes for _, s, _ in out)
        assert abs(measured - formula(psi)) <= 0.10 * formula(psi), (stage, measured,
                                                                     formula(psi))


def test_ddp_holds_each_gradient_once():
    """DDP with Adam in float32 holds 16Ψ (parameters, bucketed gradients that p.grad views,
    two moments), PyTorch's gradient_as_bucket_view; before, it held 20Ψ."""
    def run(comm):
        psi, strategy, _ = measure(comm, lambda c: AllReduceStrategy(c, algorithm="ring"))
        x, y = data("mlp", "float32")
        F.cross_entropy(strategy.model(Tensor(x[:2])), y[:2]).backward()
        strategy.ddp.finish()  # the peak: gradients ready, before the optimizer step
        for p in strategy.model.parameters():
            assert any(p.grad.base is b.buffer for b in strategy.ddp.buckets)
        return psi, strategy.ddp.model_state_bytes(strategy.optimizer)

    for psi, measured in run_world(4, run):
        assert abs(measured - 16 * psi) <= 0.10 * 16 * psi, (measured, 16 * psi)


def sent(p: int, make) -> tuple[list[int], list]:
    """Bytes each rank sent in two steps, counted from the message log."""
    out, _ = run_world(p, lambda comm: measure(comm, make), message_log=True)
    return [n for _, _, n in out], [s for _, s, _ in out]


def test_sent_bytes():
    """Stages 1 and 2 send what ring DDP sends (reduce-scatter + all-gather = all-reduce),
    stage 3 about 1.5 times that; the strategy's own count agrees with the message log."""
    p = 4
    ddp, _ = sent(p, lambda c: AllReduceStrategy(c, algorithm="ring", first_bucket_mb=1e-3,
                                                 bucket_mb=2e-3))
    psi = sum(q.data.size for q in deep_mlp().parameters())
    for rank_bytes in ddp:  # two steps of ring all-reduces: ≈ 2·2Ψ(p-1)/p·4 bytes
        assert abs(rank_bytes - 2 * 2 * psi * (p - 1) / p * 4) < 0.02 * rank_bytes
    for stage, factor in ((1, 1.0), (2, 1.0), (3, 1.5)):
        counted, strategies = sent(p, lambda c, s=stage: ZeroStrategy(
            c, s, algorithm="ring", first_bucket_mb=1e-3, bucket_mb=2e-3))
        for rank, (mine, theirs) in enumerate(zip(counted, ddp, strict=True)):
            if stage < 3:
                assert mine == theirs, (stage, rank, mine, theirs)
            else:
                assert abs(mine - factor * theirs) < 0.02 * theirs
            assert strategies[rank].sent_bytes_per_step == pytest.approx(max(counted) / 2)


@pytest.mark.parametrize("flags, message", [
    ({"parallel.zero": 4}, r"parallel\.zero: expected a stage 1, 2 or 3"),
    ({"parallel.zero": 1, "parallel.mode": "ps"},
     r"parallel\.zero cannot be combined with parallel\.mode ps"),
    ({"parallel.zero": 2, "communication.compression": "fp16"},
     r"communication\.compression fp16"),
    ({"parallel.zero": 3, "communication.sync_every": 2}, r"communication\.sync_every"),
    ({"parallel.zero": 1, "communication.algorithm": "rabenseifner"},
     r"communication\.algorithm rabenseifner"),
    ({"communication.algorithm": "pat"}, r"communication\.algorithm pat has no all-reduce"),
    ({"parallel.prefetch": False}, r"parallel\.prefetch needs parallel\.zero 3"),
])
def test_config_errors(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(TrainConfig.from_keys(flags), 3)


def test_checkpoint_reshards_across_ranks_and_stages(tmp_path):
    """ZeRO-3 on 4 ranks for one epoch writes a sharded checkpoint (a shard per rank and a
    manifest); ZeRO-1 on 3 ranks, DDP on 1 and ZeRO-3 on 2 continue from it and end where the
    uninterrupted single-rank run ends."""
    def first(comm):
        _, _, strategy = train(comm, zero(3), "mlp", "adam", "float64")
        shard, manifest = strategy.checkpoint_shard()
        checkpoint.save_sharded_checkpoint(tmp_path, comm, shard, {"manifest": manifest})

    run_world(4, first)
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        *(f"shard-0000{r}.npz" for r in range(4)), "state.json"]

    def resume(comm, make):
        model_state, optimizer_state, _ = checkpoint.load_checkpoint(tmp_path)
        m = make_model("mlp", "float64")
        x, y = data("mlp", "float64")
        strategy = make(comm)
        strategy.setup(m, OPTIMIZERS["adam"])
        with strategy.gathered():
            m.load_state_dict(model_state)
        strategy.load_state_dict(optimizer_state)
        sampler = DistributedSampler(N, 7, rank=comm.rank, num_replicas=comm.size, seed=1)
        sampler.set_epoch(1)
        for idx, global_batch in sampler:
            strategy.step(Batch(x[idx], y[idx], global_batch, strategy.optimizer.lr))
        with strategy.gathered():
            return np.concatenate([p.data.ravel().copy() for p in m.parameters()])

    ref = reference("mlp", "adam", "float64", epochs=2)[0]
    for p, make in ((3, zero(1)), (1, AllReduceStrategy), (2, zero(3))):
        for params in run_world(p, lambda c, mk=make: resume(c, mk)):
            np.testing.assert_allclose(params, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("p, per_node", [(4, 2), (6, 3), (6, 2)])
def test_hybrid_follows_ddp(stage, p, per_node):
    """Sharded within nodes of per_node ranks, replicated across them."""
    ref = reference("mlp", "adam", "float64")[0]
    out = run_world(p, lambda c: train(c, zero(stage, hybrid=True), "mlp", "adam", "float64"),
                    ranks_per_node=per_node)
    for params, _, strategy in out:
        assert strategy.shard_comm.size == per_node
        assert strategy.replica_comm.size == p // per_node
        np.testing.assert_allclose(params, ref, rtol=0, atol=1e-10)


def test_hybrid_needs_equal_nodes():
    with pytest.raises(ValueError, match="same number of ranks on every node"):
        run_world(3, lambda c: ZeroStrategy(c, 1, hybrid=True), ranks_per_node=2)


def test_lars_and_lamb_without_shards_are_the_textbook_updates():
    """The two-pass LARS/LAMB (one sum_squares call) against the formulas written out here."""
    rng = np.random.default_rng(0)
    shapes = ((3, 4), (4,), (2, 2, 2))
    w0 = [rng.standard_normal(s) for s in shapes]
    grads = [[rng.standard_normal(s) for s in shapes] for _ in range(3)]

    def run(cls, **kw):
        ps = [Tensor(w.copy(), requires_grad=True) for w in w0]
        o = cls(ps, **kw)
        for step in grads:
            for p, g in zip(ps, step, strict=True):
                p.grad = g
            o.step()
        return [p.data for p in ps]

    lr, wd, eta, mu = 0.1, 0.01, 0.001, 0.9
    w, buf = [a.copy() for a in w0], [None] * 3
    for step in grads:
        for i, g in enumerate(step):
            d = g
            if w[i].ndim > 1:
                wn, gn = np.linalg.norm(w[i]), np.linalg.norm(g)
                d = (g + wd * w[i]) * (eta * wn / (gn + wd * wn))
            buf[i] = d.copy() if buf[i] is None else mu * buf[i] + d
            w[i] = w[i] - lr * buf[i]
    for a, b in zip(run(optim.LARS, lr=lr, weight_decay=wd, eta=eta, momentum=mu), w,
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)

    b1, b2, eps, lr = 0.9, 0.999, 1e-6, 0.01
    w, m, v = [a.copy() for a in w0], [0.0] * 3, [0.0] * 3
    for t, step in enumerate(grads, start=1):
        for i, g in enumerate(step):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            u = (m[i] / (1 - b1**t)) / (np.sqrt(v[i] / (1 - b2**t)) + eps)
            if w[i].ndim > 1:
                u = u + wd * w[i]
                u = u * (np.linalg.norm(w[i]) / np.linalg.norm(u))
            w[i] = w[i] - lr * u
    for a, b in zip(run(optim.LAMB, lr=lr, weight_decay=wd, eps=eps), w, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def mpdl_train(n: int, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    binary = Path(sys.executable).parent
    cmd = ["timeout", "-k", "5", "120", str(binary / "mpiexec"), "-n", str(n),
           str(binary / "mpdl"), "train", "--no-progress", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=135,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("flags, message", [
    (["--zero", "4"], "--zero: expected a stage 1, 2 or 3, got 4"),
    (["--zero", "1", "--mode", "ps"], "--zero cannot be combined with --mode ps"),
    (["--zero", "2", "--compression", "topk"], "--compression topk"),
    (["--zero", "3", "--sync-every", "2"], "--sync-every"),
    (["--zero", "1", "--algorithm", "torus2d"], "--algorithm torus2d has no reduce-scatter"),
    (["--no-prefetch"], "--no-prefetch needs --zero 3"),
    (["--zero-hybrid"], "--zero-hybrid needs --zero"),
])
def test_bad_zero_flags_exit_2_with_one_line(flags, message):
    out = mpdl_train(2, *flags)
    assert out.returncode == 2, (out.stdout, out.stderr)
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("mpdl train: error: "), out.stderr
    assert message in errors[0]


def test_zero_train_reports_state_and_bytes(tmp_path):
    out = mpdl_train(2, "--zero", "2", "--epochs", "2", "--algorithm", "ring", "--json",
                     str(tmp_path / "r.jsonl"))
    assert out.returncode == 0, out.stderr
    assert "ZeRO stage 2" in out.stdout and "state_MiB" in out.stdout and "sent_MiB" in out.stdout
    first, *rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert first["config"]["parallel"]["zero"] == 2
    psi = 64 * 128 + 128 + 128 * 10 + 10  # the digits MLP
    for row in rows:
        assert row["mode"] == "zero" and row["zero_stage"] == 2
        assert row["sent_bytes_per_step"] == 2 * psi * 4 * (2 - 1) / 2  # ring, p = 2
        assert 4 * psi + 12 * psi / 2 <= row["model_state_bytes"] <= 16 * psi
    plain = mpdl_train(2, "--epochs", "1")
    assert "state_MiB" not in plain.stdout  # the columns only with --zero


def test_named_units_of_a_resnet():
    """ResNet8 keeps its blocks as attributes: stage 3 shards them when named as units, and
    follows DDP (batch norm's statistics are per rank in both, so the oracle is DDP on p ranks)."""
    def body(comm, make):
        m = build_model("resnet8", (3, 8, 8), 10, seed=0, dtype=np.dtype("float64"))
        strategy = make(comm)
        strategy.setup(m, OPTIMIZERS["sgd"])
        rng = np.random.default_rng(0)
        x, y = rng.standard_normal((6, 3, 8, 8)), rng.integers(0, 10, 6)
        for _ in range(2):
            mine = slice(3 * comm.rank, 3 * comm.rank + 3)
            strategy.step(Batch(x[mine], y[mine], 6, 0.05))
        with strategy.gathered():
            return np.concatenate([p.data.ravel().copy() for p in m.parameters()]), strategy

    ref = run_world(2, lambda c: body(c, AllReduceStrategy))[0][0]
    units = ["layer1", "layer2", "layer3"]
    out = run_world(2, lambda c: body(c, lambda cc: ZeroStrategy(cc, 3, units=units)))
    params, strategy = out[0]
    assert [u.module for u in strategy.units[:3]] == [getattr(strategy.model, n) for n in units]
    np.testing.assert_allclose(params, ref, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="units: no submodule named 'layer9'"):
        run_world(1, lambda c: body(c, lambda cc: ZeroStrategy(cc, 3, units=["layer9"])))
