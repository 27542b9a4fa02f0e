"""Context parallelism on the in-process world: the attention function alone (each mode, each
split, causal or not, forward and backward) against unsharded scaled-dot-product attention, the
layout of the sequence, the 4-axis grid, and the GPT trained with cp (and with Megatron sequence
parallelism) following one process."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from oracle import adam_losses

import mpdl.autograd.functional as F
from mpdl.autograd import optim
from mpdl.autograd.tensor import Tensor
from mpdl.collectives import allreduce
from mpdl.models.gpt import GPT
from mpdl.parallel.context import (
    block_work,
    chunks_of,
    context_attention,
    positions,
    reference_attention,
    shard_sequence,
)
from mpdl.parallel.grid import ProcessGrid
from mpdl.parallel.pipeline import PipelineStrategy
from mpdl.parallel.strategy import Batch
from mpdl.threadworld import run_world
from mpdl.training.config import ConfigError, TrainConfig, validate
from mpdl.training.loop import Trainer

TOL = {np.float64: 1e-10, np.float32: 1e-5}
MODES = ["ring", "allgather", "ulysses"]


def sharded_attention(cp, q, k, v, g, mode, balance, causal):
    """Each rank's (out, dq, dk, dv) from context_attention over `cp` in-process ranks."""
    def body(comm):
        def mine(a):
            return shard_sequence(a, comm.rank, cp, balance, axis=2)
        qs, ks, vs = (Tensor(mine(a), requires_grad=True) for a in (q, k, v))
        out = context_attention(qs, ks, vs, comm, mode, balance, causal)
        (out * Tensor(mine(g))).sum().backward()
        return out.data, qs.grad, ks.grad, vs.grad
    return run_world(cp, body)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_attention_matches_the_unsharded_one_forward_and_backward(mode, dtype):
    rng = np.random.default_rng(abs(hash((mode, dtype.__name__))) % 2**32)
    for _ in range(10):
        cp = int(rng.integers(1, 6))
        balance = str(rng.choice(["zigzag", "contiguous"]))
        causal = bool(rng.integers(0, 2))
        chunk = int(rng.integers(1, 4))
        t = cp * chunk * (2 if balance == "zigzag" else 1)
        heads = cp * int(rng.integers(1, 3)) if mode == "ulysses" else int(rng.integers(1, 4))
        b, d = int(rng.integers(1, 3)), int(rng.integers(1, 5))
        q, k, v, g = (rng.standard_normal((b, heads, t, d)).astype(dtype) for _ in range(4))
        tq, tk, tv = (Tensor(a, requires_grad=True) for a in (q, k, v))
        (F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal) * Tensor(g)).sum().backward()
        want = F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v),
                                              is_causal=causal).data
        case = f"cp {cp} T {t} heads {heads} {balance} causal {causal}"
        for rank, got in enumerate(sharded_attention(cp, q, k, v, g, mode, balance, causal)):
            for name, mine, whole in zip(("out", "dq", "dk", "dv"), got,
                                         (want, tq.grad, tk.grad, tv.grad), strict=True):
                assert mine.dtype == dtype
                np.testing.assert_allclose(mine, shard_sequence(whole, rank, cp, balance, axis=2),
                                           rtol=0, atol=TOL[dtype],
                                           err_msg=f"{mode} {name} rank {rank} {case}")


def test_the_naive_version_gives_the_same_rows():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 12, 3)) for _ in range(3))
    want = F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v), is_causal=True).data

    def body(comm):
        return reference_attention(*(shard_sequence(a, comm.rank, 3, "zigzag", axis=2)
                                     for a in (q, k, v)), comm, balance="zigzag")
    for rank, rows in enumerate(run_world(3, body)):
        np.testing.assert_allclose(rows, want[..., positions(rank, 3, 12, "zigzag"), :],
                                   atol=1e-12)


def test_zigzag_gives_every_rank_the_same_causal_work_and_contiguous_does_not():
    assert chunks_of(1, 4, "zigzag") == [1, 6] and chunks_of(1, 4, "contiguous") == [1]
    assert list(positions(0, 2, 8, "zigzag")) == [0, 1, 6, 7]
    assert list(positions(1, 2, 8, "contiguous")) == [4, 5, 6, 7]
    for cp in (2, 3, 4, 8):
        zigzag = [block_work(r, cp, "zigzag") for r in range(cp)]
        contiguous = [block_work(r, cp, "contiguous") for r in range(cp)]
        assert len(set(zigzag)) == 1 and zigzag[0] == pytest.approx(4 * cp * cp / 2 / cp)
        assert contiguous == [r + 0.5 for r in range(cp)]  # rank r: r full blocks + a triangle
    with pytest.raises(ValueError, match="divisible by 2·cp = 6"):
        positions(0, 3, 9, "zigzag")


def test_ulysses_needs_heads_divisible_by_cp():
    q = Tensor(np.zeros((1, 3, 4, 2)))
    with pytest.raises(ValueError, match="the 3 heads must be divisible by cp = 2"):
        run_world(2, lambda comm: context_attention(q, q, q, comm, "ulysses"))


def test_grid_of_four_axes_is_row_major_tp_fastest_then_cp():
    def body(comm):
        g = ProcessGrid(comm, 2, 1, 2, cp=3)
        sums = [int(allreduce(np.array([comm.rank]), comm=c)[0])
                for c in (g.dp_comm, g.cp_comm, g.tp_comm, g.dcp_comm)]
        return (g.d, g.p, g.c, g.t), sums

    for rank, ((d, p, c, t), sums) in enumerate(run_world(12, body)):
        assert rank == ((d * 1 + p) * 3 + c) * 2 + t
        assert sums == [sum((dd * 3 + c) * 2 + t for dd in range(2)),
                        sum((d * 3 + cc) * 2 + t for cc in range(3)),
                        sum((d * 3 + c) * 2 + tt for tt in range(2)),
                        sum((dd * 3 + cc) * 2 + t for dd in range(2) for cc in range(3))]


N, STEPS = 6, 3


def gpt(length):
    return GPT(vocab_size=11, block_size=length, n_layer=2, n_head=4, n_embd=8, seed=0,
               dtype=np.float64)


def one_process(x, y):
    model = gpt(x.shape[1])
    return adam_losses(model, x, y, STEPS, 1e-2)


@pytest.mark.parametrize("dp, pp, tp, cp, mode, balance, sp", [
    (1, 1, 1, 2, "ring", "zigzag", False), (1, 1, 1, 3, "allgather", "contiguous", False),
    (2, 1, 1, 2, "ulysses", "zigzag", False), (1, 1, 2, 2, "ring", "contiguous", False),
    (1, 2, 1, 2, "ring", "zigzag", False), (1, 1, 2, 2, "ring", "zigzag", True),
    (1, 1, 2, 1, "ring", "zigzag", True), (1, 2, 2, 1, "ring", "zigzag", True)])
def test_the_gpt_with_context_parallelism_follows_one_process(dp, pp, tp, cp, mode, balance, sp):
    rng = np.random.default_rng(5)
    length = 12 if cp == 3 else 8
    x, y = rng.integers(0, 11, (N, length)), rng.integers(0, 11, (N, length))
    y[:, :length // 2 + 1] = -100  # a prompt without targets (as on the addition task)

    def body(comm):
        s = PipelineStrategy(comm, dp, pp, tp, microbatches=2, cp=cp, cp_mode=mode,
                             cp_balance=balance, sp=sp)
        s.setup(gpt(length), lambda p: optim.Adam(p, lr=1e-2))
        bounds = np.linspace(0, N, dp + 1).astype(int)
        d, losses = s.data_comm.rank, []
        for _ in range(STEPS):
            r = s.step(Batch(x[bounds[d]:bounds[d + 1]], y[bounds[d]:bounds[d + 1]], N, 1e-2))
            total = allreduce(np.array([r.loss, r.samples]), comm=s.data_comm)
            losses.append(total[0] / total[1])
        return losses

    want = one_process(x, y)
    for rank, losses in enumerate(run_world(dp * pp * tp * cp, body)):
        np.testing.assert_allclose(losses, want, rtol=0, atol=1e-10, err_msg=f"rank {rank}")


#: a tiny GPT on a short text in sequences of 8 characters
TINY = {"model.name": "gpt", "data.dataset": "text", "model.block_size": 8, "model.n_layer": 2,
        "model.n_head": 2, "model.n_embd": 8, "optim.global_batch_size": 12,
        "optim.optimizer": "adam", "output.progress": False, "optim.lr_schedule": "constant"}
TEXT = "the cat sat on the mat; the dog sat on the log.\n" * 8


def train(config: TrainConfig, comm) -> tuple[np.ndarray, list[dict]]:
    trainer = Trainer(config, comm=comm, out=io.StringIO())
    trainer.setup()
    rows = trainer.run()
    with trainer.strategy.gathered():
        return np.concatenate([p.data.ravel() for p in trainer.model.parameters()]), rows


def test_mpdl_train_with_cp_follows_one_rank_and_its_checkpoints_load_on_any_layout(tmp_path):
    (tmp_path / "text.txt").write_text(TEXT)
    tiny = {**TINY, "data.path": str(tmp_path / "text.txt")}
    ref, ref_rows = run_world(1, lambda c: train(TrainConfig.from_keys(
        {**tiny, "optim.epochs": 2}), c))[0]
    ckpt = {"checkpoint.dir": str(tmp_path / "ckpt")}
    for kw in ({"parallel.cp": 2, "parallel.dp": 2, "parallel.cp_mode": "ulysses", **ckpt},
               {"parallel.cp": 2, "parallel.tp": 2, "parallel.sp": True}):
        for _, rows in run_world(4, lambda c, kw=kw: train(TrainConfig.from_keys(
                {**tiny, "optim.epochs": 1, **kw}), c)):
            assert rows[0]["loss"] == pytest.approx(ref_rows[0]["loss"], abs=1e-5)
            assert rows[-1]["cp"] == 2
    for params, _ in run_world(1, lambda c: train(TrainConfig.from_keys(
            {**tiny, "optim.epochs": 2, **ckpt, "checkpoint.resume": True}), c)):
        np.testing.assert_allclose(params, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kw, message", [
    ({"parallel.cp": 2, "model.block_size": 6},
     "parallel.cp 2 with parallel.cp_balance zigzag: the sequence length 6 must be divisible by "
     "4 \\(2 x cp chunks\\)"),
    ({"parallel.cp": 4, "parallel.cp_balance": "contiguous", "model.block_size": 6},
     "parallel.cp 4 with parallel.cp_balance contiguous: the sequence length 6 must be divisible "
     "by 4"),
    ({"parallel.cp": 4, "parallel.cp_mode": "ulysses", "model.n_head": 2, "model.n_embd": 8},
     "parallel.cp_mode ulysses: parallel.cp 4 must divide the 2 heads"),
    ({"parallel.sp": True}, "parallel.sp needs parallel.tp > 1"),
    ({"parallel.cp": 2, "model.name": "mlp", "data.dataset": "digits"},
     "parallel.cp > 1 needs model.name gpt"),
    ({"parallel.cp": 2, "parallel.cp_mode": "star"},
     "parallel.cp_mode: expected one of ring, allgather, ulysses"),
    ({"parallel.cp": 0}, "parallel.cp: expected a positive number, got 0"),
])
def test_bad_context_configurations_say_which_option(kw, message):
    config = TrainConfig.from_keys({**TINY, "data.path": "text.txt", **kw})
    with pytest.raises(ConfigError, match=message):
        validate(config, 4)


def test_a_bad_cp_flag_stops_every_rank_with_one_line_and_exit_2():
    binary = Path(sys.executable).parent
    cmd = ["timeout", "-k", "5", "120", str(binary / "mpiexec"), "-n", "2", str(binary / "mpdl"),
           "train", "--no-progress", "--model", "gpt", "--dataset", "addition", "--digits", "1",
           "--cp", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=135, env=dict(os.environ))
    assert out.returncode == 2, (out.stdout, out.stderr)
    errors = out.stderr.strip().splitlines()
    assert errors == ["mpdl train: error: --cp 2 with --cp-balance zigzag: the sequence length 5 "
                      "must be divisible by 4 (2 x cp chunks)"], out.stderr
