"""The mixture-of-experts layer on one process: routing and capacity against a loop written from
the definition, gradients (through the top-k gates and the load-balancing loss) against central
differences on a residual graph like the GPT's, and against PyTorch (optional oracle)."""

import math

import numpy as np
import pytest

import mpdl.autograd.functional as F
from mpdl import memory
from mpdl.autograd import Tensor, gradcheck
from mpdl.models.gpt import GPT
from mpdl.models.moe import (
    MoE,
    MoESettings,
    aux_loss_scale,
    concat_rows,
    expert_capacity,
    route,
)


def routing_by_loops(probs, k, capacity):
    """(chosen experts per token, kept (token, expert) pairs) from the definition: each token's
    k most likely experts (lower index on ties), each expert keeping its earliest tokens."""
    chosen = [sorted(range(probs.shape[1]), key=lambda e, row=row: (-row[e], e))[:k]
              for row in probs]
    taken = [0] * probs.shape[1]
    kept = []
    for n, experts in enumerate(chosen):
        for e in experts:
            if not capacity or taken[e] < capacity:
                taken[e] += 1
                kept.append((n, e))
    return chosen, kept


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("capacity", [0, 1, 3, 7])
def test_route_keeps_the_earliest_tokens_of_each_expert(k, capacity):
    rng = np.random.default_rng(capacity + 10 * k)
    probs = rng.dirichlet(np.ones(5), size=13)
    probs[4] = probs[3]  # a repeated row and a tie inside a row
    probs[6, 1] = probs[6, 3] = probs[6].max() + 0.1
    r = route(probs, k, capacity)
    chosen, kept = routing_by_loops(probs, k, capacity)
    np.testing.assert_array_equal(r.chosen, chosen)
    assert sorted((int(i) // k, int(r.chosen.reshape(-1)[i])) for i in r.order) == sorted(kept)
    experts_in_order = r.chosen.reshape(-1)[r.order]
    assert list(experts_in_order) == sorted(experts_in_order)  # sorted by expert ...
    assert r.counts.sum() == 13 * k and r.kept.sum() == len(kept)
    assert r.dropped == 13 * k - len(kept)


def test_capacity_formula():
    assert expert_capacity(10, 2, 4, 0.0) == 0
    assert expert_capacity(10, 2, 4, 1.0) == 5
    assert expert_capacity(10, 1, 4, 1.25) == math.ceil(10 / 4 * 1.25) == 4
    assert expert_capacity(3, 2, 4, 1.0) == 2


def residual_graph(moe, x):
    """x + moe(layer_norm(x)), the MoE half of a GPT block."""
    return x + moe(F.layer_norm(x, x.shape[-1]))


def bind(moe, arrays):
    """The module's parameters replaced by the given tensors, in named_parameters order."""
    names = [n for n, _ in moe.named_parameters()]
    for name, t in zip(names, arrays, strict=True):
        *path, leaf = name.split(".")
        module = moe
        for part in path:
            module = getattr(module, part)
        module._parameters[leaf] = t


@pytest.mark.parametrize("k,cf", [(2, 0.0), (2, 1.0), (1, 1.0)])
def test_gradients_through_gates_and_aux_loss_match_central_differences(k, cf):
    moe = MoE(3, 3, top_k=k, capacity_factor=cf, aux_loss_coef=0.5, seed=1, dtype=np.float64)
    x = np.random.default_rng(2).standard_normal((2, 4, 3))
    params = [p.data.copy() for p in moe.parameters()]
    moe.router.weight.data[...] *= 20  # a confident router: gates far from uniform

    def with_aux_in_graph(x, *arrays):
        bind(moe, arrays)
        with aux_loss_scale(0.0):  # the aux loss enters through the returned value only
            y = residual_graph(moe, x)
        return concat_rows([y.reshape(-1), moe.last_aux_loss.reshape(1)])

    params[0] = moe.router.weight.data.copy()
    gradcheck(with_aux_in_graph, x, *params, atol=1e-6, rtol=1e-4)
    if cf:
        assert moe.last_routing.dropped > 0  # some routings were dropped


def test_aux_loss_enters_backward_at_the_layer_output():
    """With the default aux_loss_scale the gradient is that of (task loss + L_aux) · scale."""
    moe = MoE(3, 3, top_k=2, aux_loss_coef=0.3, seed=3, dtype=np.float64)
    x = np.random.default_rng(4).standard_normal((4, 3))
    target = np.random.default_rng(5).standard_normal((4, 3))
    scale = float(np.random.default_rng(0).standard_normal(()))  # gradcheck's cotangent

    def loss_plus_aux_value(x, *arrays):
        bind(moe, arrays)
        with aux_loss_scale(scale):
            y = residual_graph(moe, x)
        return ((y - Tensor(target)) ** 2).sum() + Tensor(moe.last_aux_loss.data)

    gradcheck(loss_plus_aux_value, x, *[p.data.copy() for p in moe.parameters()], atol=1e-6,
              rtol=1e-4)


def test_aux_loss_value_is_switch_generalised_to_top_k():
    moe = MoE(4, 3, top_k=2, aux_loss_coef=0.01, seed=6)
    x = np.random.default_rng(7).standard_normal((10, 4)).astype(np.float32)
    moe(Tensor(x))
    logits = x.astype(np.float64) @ moe.router.weight.data.T.astype(np.float64)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    top2 = np.argsort(-p, axis=1)[:, :2]
    f = np.bincount(top2.reshape(-1), minlength=3) / (10 * 2)
    expected = 0.01 * 3 * np.sum(f * p.mean(0))
    assert moe.last_aux_loss.item() == pytest.approx(expected, rel=1e-5)
    assert moe.last_aux_loss.dtype == np.float32  # the router's float32


def test_router_runs_in_float32_for_a_float32_model():
    moe = MoE(4, 2, top_k=1, seed=0, dtype=np.float32)
    assert moe.router.weight.dtype == np.float32
    assert MoE(4, 2, top_k=1, seed=0, dtype=np.float64).router.weight.dtype == np.float64
    y = moe(Tensor(np.ones((2, 3, 4), np.float32), requires_grad=True))
    assert y.shape == (2, 3, 4) and y.dtype == np.float32


def test_a_token_with_every_routing_dropped_passes_through_the_residual():
    moe = MoE(4, 2, top_k=1, capacity_factor=0.5, seed=0, dtype=np.float64)
    moe.router.weight.data[...] = 0
    moe.router.weight.data[0, 0] = 10  # every token (positive first feature) goes to expert 0
    x = np.abs(np.random.default_rng(1).standard_normal((6, 4))) + 0.1
    y = moe(Tensor(x)).data
    capacity = expert_capacity(6, 1, 2, 0.5)
    assert capacity == 2 and moe.last_routing.dropped == 4
    assert np.all(y[capacity:] == 0) and np.all(np.abs(y[:capacity]).sum(1) > 0)


@pytest.mark.parametrize("kwargs,match", [
    ({"top_k": 3}, "top_k must be 1 or 2"),
    ({"num_experts": 1, "top_k": 2}, r"top_k \(2\) must not exceed num_experts \(1\)"),
    ({"capacity_factor": -1.0}, "capacity_factor must be >= 0"),
    ({"aux_loss_coef": -0.1}, "aux_loss_coef must be >= 0"),
    ({"num_experts": 0}, "num_experts must be a positive int")])
def test_bad_arguments_name_the_argument(kwargs, match):
    args = {"n_embd": 4, "num_experts": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        MoE(**args)


def test_gpt_with_moe_every_other_block():
    moe = MoESettings(experts=4, top_k=2, every=2)
    gpt = GPT(11, 8, 3, 2, 8, seed=0, moe=moe)
    kinds = [type(b.mlp).__name__ for b in gpt.blocks]
    assert kinds == ["MoE", "MLP", "MoE"]
    names = dict(gpt.named_parameters())
    assert "blocks.0.mlp.router.weight" in names and "blocks.2.mlp.experts.3.proj.bias" in names
    assert np.std(names["blocks.0.mlp.experts.1.fc.weight"].data) == pytest.approx(0.02, rel=0.1)
    dense = GPT(11, 8, 3, 2, 8, seed=0)
    expert = sum(p.size for p in gpt.blocks[0].mlp.experts[0].parameters())
    router = gpt.blocks[0].mlp.router.weight.size
    # a token uses k = 2 experts of 4 and the router, in two of three blocks
    assert gpt.flops_per_token() - dense.flops_per_token() == 6 * 2 * (expert + router)
    logits = gpt(np.zeros((2, 8), np.int64))
    F.cross_entropy(logits, np.ones((2, 8), np.int64)).backward()
    assert names["blocks.0.mlp.router.weight"].grad is not None


# ---------------------------------------------------------------------- PyTorch as the oracle
def torch_moe(torch, x, router_w, experts, k, capacity, alpha):
    """The layer written with PyTorch ops from the definition (loops for the capacity)."""
    n, c = x.shape
    e = router_w.shape[0]
    probs = torch.softmax(x @ router_w.T, dim=-1)
    chosen, kept = routing_by_loops(probs.detach().numpy(), k, capacity)
    out = torch.zeros_like(x)
    for t, expert in kept:
        j = chosen[t].index(expert)
        gates = probs[t, chosen[t]]
        gate = gates[j] / gates.sum() if k > 1 else gates[j]
        w1, b1, w2, b2 = experts[expert]
        h = torch.nn.functional.gelu(x[t] @ w1.T + b1)
        out = out.index_add(0, torch.tensor([t]), (gate * (h @ w2.T + b2))[None])
    f = torch.tensor(np.bincount(np.array(chosen).reshape(-1), minlength=e) / (n * k))
    aux = alpha * e * (f * probs.mean(0)).sum()
    return out, aux


@pytest.mark.parametrize("k,cf", [(2, 0.0), (1, 1.0), (2, 0.75)])
def test_forward_and_gradients_match_pytorch(k, cf):
    torch = pytest.importorskip("torch", reason="PyTorch is the optional oracle")
    moe = MoE(5, 4, top_k=k, capacity_factor=cf, aux_loss_coef=0.2, seed=8, dtype=np.float64)
    moe.router.weight.data[...] *= 30
    x = np.random.default_rng(9).standard_normal((12, 5))
    ours_x = Tensor(x, requires_grad=True)
    y = moe(ours_x)
    cot = np.random.default_rng(10).standard_normal(y.shape)
    (y * Tensor(cot)).sum().backward()

    tx = torch.tensor(x, requires_grad=True)
    tr = torch.tensor(moe.router.weight.data, requires_grad=True)
    texp = [[torch.tensor(p.data, requires_grad=True) for p in (ex.fc.weight, ex.fc.bias,
                                                                 ex.proj.weight, ex.proj.bias)]
            for ex in moe.experts]
    capacity = expert_capacity(12, k, 4, cf)
    out, aux = torch_moe(torch, tx, tr, texp, k, capacity, 0.2)
    ((out * torch.tensor(cot)).sum() + aux).backward()
    np.testing.assert_allclose(y.data, out.detach().numpy(), rtol=1e-10, atol=1e-12)
    assert moe.last_aux_loss.item() == pytest.approx(aux.item(), rel=1e-12)
    np.testing.assert_allclose(ours_x.grad, tx.grad.numpy(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(moe.router.weight.grad, tr.grad.numpy(), rtol=1e-9, atol=1e-12)
    for ex, theirs in zip(moe.experts, texp, strict=True):
        for p, t in zip((ex.fc.weight, ex.fc.bias, ex.proj.weight, ex.proj.bias), theirs,
                        strict=True):
            expected = t.grad.numpy() if t.grad is not None else np.zeros_like(p.data)
            got = p.grad if p.grad is not None else np.zeros_like(p.data)
            np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)
    if cf:
        assert moe.last_routing.dropped > 0


def _moe_gpt_gradients(mode: str, capacity_factor: float):
    """Gradients, dropout state, MoE statistics and the activation peak of two steps of a GPT
    whose every MLP is a mixture of experts, with dropout 0.2, recomputing `mode`."""
    model = GPT(13, 12, 2, 2, 16, dropout=0.2, seed=3,
                moe=MoESettings(4, top_k=2, capacity_factor=capacity_factor))
    model.set_recompute(mode)
    rng = np.random.default_rng(1)
    ledger = memory.Ledger()
    with ledger.installed():
        for _ in range(2):
            for p in model.parameters():
                p.grad = None
            x, y = rng.integers(0, 13, (5, 12)), rng.integers(0, 13, (5, 12))
            F.cross_entropy(model(x), y).backward()
    stats = [(m.stats.tokens_per_expert.tolist(), m.stats.dropped, m.stats.aux_loss,
              m.stats.calls) for _, m in model.named_modules() if isinstance(m, MoE)]
    return ([p.grad for p in model.parameters()], model.dropout.rng.bit_generator.state, stats,
            ledger.peak["activations"])


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_recomputation_with_experts_gives_the_same_gradients_bit_for_bit(capacity_factor):
    """Selective (the attention core) and full (the attention sublayer; the MoE sublayer keeps
    its saved tensors, its routing runs once) against no recomputation, dropless and dropping:
    every gradient bit for bit, dropout where it would be, each layer routed once a forward."""
    reference, state, stats, none_peak = _moe_gpt_gradients("none", capacity_factor)
    assert all(calls == 2 for *_, calls in stats)
    peaks = []
    for mode in ("selective", "full"):
        grads, after, routed, peak = _moe_gpt_gradients(mode, capacity_factor)
        assert all(np.array_equal(a, b) for a, b in zip(reference, grads, strict=True)), mode
        assert after == state and routed == stats, mode
        peaks.append(peak)
    assert none_peak > peaks[0] > peaks[1]
