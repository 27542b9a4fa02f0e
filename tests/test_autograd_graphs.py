"""The backward engine on graphs shaped like real models, not chains: random DAGs with shared
intermediates reused at different depths, residual blocks written both ways, a layer norm built
from primitives and ResNet-8, against numerical gradients and (where installed) PyTorch."""

import numpy as np
import pytest

import mpdl.autograd.functional as F
from mpdl.autograd import Tensor
from mpdl.autograd.gradcheck import gradcheck
from mpdl.models.zoo import BasicBlock, ResNet8

try:
    import torch
except ImportError:  # PyTorch is an optional oracle
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is the optional oracle here")

# Leaves of every random graph: two activations, a row and a vector that broadcast, a weight.
LEAF_SHAPES = [(3, 4), (3, 4), (1, 4), (4,), (4, 4)]
NODE_SHAPE = (3, 4)


def _sum(a, axis):
    return a.sum(axis=axis, keepdims=True) if isinstance(a, Tensor) else a.sum(axis, keepdim=True)


def _mean(a, axis):
    return a.mean(axis=axis, keepdims=True) if isinstance(a, Tensor) else a.mean(axis, keepdim=True)


def _full(a):
    """a broadcast to the node shape (a no-op on nodes, which already have it)."""
    if tuple(a.shape) == NODE_SHAPE:
        return a
    return a + (np.zeros(NODE_SHAPE) if isinstance(a, Tensor) else torch.zeros(NODE_SHAPE,
                                                                               dtype=a.dtype))


def _softmax(a):
    return F.softmax(a, -1) if isinstance(a, Tensor) else torch.softmax(a, -1)


# op name -> (number of inputs, function of those inputs and the weight leaf). Inputs are nodes of
# shape (3, 4) or the leaves that broadcast against them; every result is made (3, 4).
OPS = {
    "add": (2, lambda a, b, w: a + b),
    "mul": (2, lambda a, b, w: a * b),
    "sub": (2, lambda a, b, w: a - b),
    "tanh": (1, lambda a, w: a.tanh()),
    "exp": (1, lambda a, w: a.tanh().exp()),
    "matmul": (1, lambda a, w: (_full(a) @ w) * 0.5),
    "matmul_nodes": (3, lambda a, b, c, w: (_full(a) @ _full(b).T) @ _full(c) * 0.2),
    "softmax": (1, lambda a, w: _softmax(a)),
    "add_rowsum": (2, lambda a, b, w: a + _sum(b, -1)),
    "mul_colmean": (2, lambda a, b, w: a * _mean(b, 0)),
    "self_rowmean": (1, lambda a, w: a - _mean(a, -1)),
}


def random_graph(seed: int, steps: int = 10) -> list[tuple[str, list[int]]]:
    """A random DAG as a list of (op, input indices). Indices 0-3 are the broadcastable leaves,
    later indices the nodes made so far; inputs are drawn from everything made, so a tensor is
    often used by several ops at different depths, and leaves are used several times."""
    rng = np.random.default_rng(seed)
    names = list(OPS)
    graph = []
    available = 4
    for _ in range(steps):
        op = names[rng.integers(len(names))]
        graph.append((op, [int(rng.integers(available)) for _ in range(OPS[op][0])]))
        available += 1
    return graph


def run_graph(graph, leaves):
    """Evaluate graph on leaves (mpdl or torch tensors); the output sums several nodes, so nodes
    reach it through paths of different lengths."""
    values = list(leaves[:4])
    weight = leaves[4]
    for op, inputs in graph:
        values.append(_full(OPS[op][1](*(values[i] for i in inputs), weight)))
    out = values[-1]
    for v in values[4::3]:
        out = out + v
    return out


def random_leaves(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + 1000)
    return [rng.standard_normal(shape) * 0.8 for shape in LEAF_SHAPES]


def engine_gradients(graph, arrays, cotangent):
    leaves = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    run_graph(graph, leaves).backward(cotangent)
    return [np.zeros_like(a) if t.grad is None else t.grad for a, t in zip(arrays, leaves,
                                                                           strict=True)]


def test_the_reported_graph():
    x = Tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    d = x + 0
    (d + d.sum(axis=-1, keepdims=True)).sum().backward()
    np.testing.assert_array_equal(x.grad, [[4.0, 4.0, 4.0]])


@pytest.mark.parametrize("seed", range(200))
def test_random_graph_matches_numerical_gradients(seed):
    graph = random_graph(seed)
    gradcheck(lambda *leaves: run_graph(graph, leaves), *random_leaves(seed), seed=seed,
              atol=1e-6, rtol=1e-4)


@needs_torch
@pytest.mark.parametrize("seed", range(200))
def test_random_graph_matches_torch(seed):
    graph = random_graph(seed, steps=14)
    arrays = random_leaves(seed)
    cotangent = np.random.default_rng(seed).standard_normal(NODE_SHAPE)
    ours = engine_gradients(graph, arrays, cotangent)
    theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
    run_graph(graph, theirs).backward(torch.tensor(cotangent))
    for o, t in zip(ours, theirs, strict=True):
        expected = np.zeros(o.shape) if t.grad is None else t.grad.numpy()
        np.testing.assert_allclose(o, expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("seed", range(50))
def test_leaf_hooks_fire_once_with_the_final_gradient(seed):
    graph = random_graph(seed, steps=14)
    arrays = random_leaves(seed)
    leaves = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    seen: dict[int, list] = {i: [] for i in range(len(leaves))}
    for i, leaf in enumerate(leaves):
        leaf.register_grad_ready_hook(lambda t, i=i: seen[i].append(t.grad.copy()))
    cotangent = np.random.default_rng(seed).standard_normal(NODE_SHAPE)
    run_graph(graph, leaves).backward(cotangent)
    for i, leaf in enumerate(leaves):
        if leaf.grad is None:
            assert seen[i] in ([], [None])
            continue
        assert len(seen[i]) == 1, f"leaf {i}: hook fired {len(seen[i])} times"
        np.testing.assert_array_equal(seen[i][0], leaf.grad)


# ---------------------------------------------------------------------- real model shapes
def mlp_branch(x, w1, w2):
    return (x @ w1).tanh() @ w2


def layer_norm_from_primitives(x, weight, bias, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = (centred * centred).mean(axis=-1, keepdims=True)
    return centred * (var + eps) ** -0.5 * weight + bias


RESIDUALS = {
    "x + f(x)": lambda x, w1, w2: x + mlp_branch(x, w1, w2),
    "f(x) + x": lambda x, w1, w2: mlp_branch(x, w1, w2) + x,
    "two blocks, pre-norm": lambda x, w1, w2: (
        lambda h: h + mlp_branch(layer_norm_from_primitives(h, 1.0, 0.0), w2, w1))(
        x + mlp_branch(layer_norm_from_primitives(x, 1.0, 0.0), w1, w2)),
}


@pytest.mark.parametrize("name", list(RESIDUALS))
def test_residual_blocks_match_numerical_gradients(name):
    rng = np.random.default_rng(1)
    gradcheck(RESIDUALS[name], rng.standard_normal((3, 5)), rng.standard_normal((5, 5)),
              rng.standard_normal((5, 5)))


def test_layer_norm_from_primitives_matches_numerical_gradients():
    rng = np.random.default_rng(2)
    gradcheck(layer_norm_from_primitives, rng.standard_normal((4, 6)), rng.standard_normal(6),
              rng.standard_normal(6))


@needs_torch
@pytest.mark.parametrize("name", list(RESIDUALS))
def test_residual_blocks_match_torch(name):
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((3, 5)), rng.standard_normal((5, 5)),
              rng.standard_normal((5, 5))]
    cotangent = rng.standard_normal((3, 5))
    ours = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    RESIDUALS[name](*ours).backward(cotangent)
    theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
    RESIDUALS[name](*theirs).backward(torch.tensor(cotangent))
    for o, t in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(o.grad, t.grad.numpy(), rtol=1e-9, atol=1e-12)


@needs_torch
def test_layer_norm_from_primitives_matches_torch():
    rng = np.random.default_rng(4)
    x, w, b = rng.standard_normal((4, 6)), rng.standard_normal(6), rng.standard_normal(6)
    cotangent = rng.standard_normal((4, 6))
    ours = [Tensor(a.copy(), requires_grad=True) for a in (x, w, b)]
    out = layer_norm_from_primitives(*ours)
    out.backward(cotangent)
    theirs = [torch.tensor(a, requires_grad=True) for a in (x, w, b)]
    expected = torch.nn.functional.layer_norm(theirs[0], (6,), theirs[1], theirs[2])
    expected.backward(torch.tensor(cotangent))
    np.testing.assert_allclose(out.data, expected.detach().numpy(), rtol=1e-9, atol=1e-12)
    for o, t in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(o.grad, t.grad.numpy(), rtol=1e-7, atol=1e-10)


def _torch_resnet8(x, p, skip_first):
    """ResNet8's forward in PyTorch, on a dict of its parameters by mpdl name."""
    TF = torch.nn.functional

    def bn(h, prefix):
        return TF.batch_norm(h, None, None, p[prefix + ".weight"], p[prefix + ".bias"],
                             training=True, eps=1e-5)

    def block(h, prefix, stride):
        out = TF.relu(bn(TF.conv2d(h, p[prefix + ".conv1.weight"], stride=stride, padding=1),
                         prefix + ".bn1"))
        out = bn(TF.conv2d(out, p[prefix + ".conv2.weight"], padding=1), prefix + ".bn2")
        skip = h
        if prefix + ".shortcut.0.weight" in p:
            skip = bn(TF.conv2d(h, p[prefix + ".shortcut.0.weight"], stride=stride),
                      prefix + ".shortcut.1")
        return TF.relu(skip + out if skip_first else out + skip)

    h = TF.relu(bn(TF.conv2d(x, p["stem.weight"], padding=1), "bn"))
    h = block(block(block(h, "layer1", 1), "layer2", 2), "layer3", 2)
    return TF.linear(h.mean((2, 3)), p["fc.weight"], p["fc.bias"])


@needs_torch
@pytest.mark.parametrize("skip_first", [False, True], ids=["out + skip", "skip + out"])
def test_resnet8_matches_torch_end_to_end(skip_first, monkeypatch):
    if skip_first:
        def forward(self, x):
            out = self.bn1(self.conv1(x)).relu()
            out = self.bn2(self.conv2(out))
            skip = x if self.shortcut is None else self.shortcut(x)
            return (skip + out).relu()
        monkeypatch.setattr(BasicBlock, "forward", forward)
    model = ResNet8((3, 8, 8), 5, np.random.default_rng(0), dtype=np.float64)
    rng = np.random.default_rng(5)
    images, labels = rng.standard_normal((4, 3, 8, 8)), rng.integers(0, 5, 4)
    loss = F.cross_entropy(model(Tensor(images)), labels)
    loss.backward()
    params = {name: torch.tensor(p.data.copy(), requires_grad=True)
              for name, p in model.named_parameters()}
    expected = torch.nn.functional.cross_entropy(
        _torch_resnet8(torch.tensor(images), params, skip_first), torch.tensor(labels))
    expected.backward()
    np.testing.assert_allclose(loss.item(), expected.item(), rtol=1e-10)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, params[name].grad.numpy(), rtol=1e-6, atol=1e-10,
                                   err_msg=name)

