"""The Tensor front and the backward engine: accumulation, hooks, graph lifetime, devices, errors."""

import weakref

import numpy as np
import pytest

import mpdl.autograd.functional as F
from mpdl.autograd import Tensor, enable_grad, is_grad_enabled, nn, no_grad
from mpdl.backend import cupy_module

DEVICES = ["cpu", pytest.param("gpu", marks=pytest.mark.skipif(
    cupy_module() is None, reason="needs CuPy and a GPU (mpdl.backend.cupy_module() is None)"))]


def test_attributes_and_conversions():
    t = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3), requires_grad=True)
    assert t.shape == (2, 3) and t.dtype == np.float32 and t.ndim == 2 and t.size == 6
    assert t.requires_grad and t.grad is None and t.is_leaf and t.device == "cpu"
    assert isinstance(t.numpy(), np.ndarray)
    assert Tensor(np.array([[2.5]])).item() == 2.5
    assert Tensor([1.0, 2.0]).dtype == np.float32
    assert Tensor(3).dtype.kind == "i"
    d = (t * 2).detach()
    assert not d.requires_grad and d.is_leaf
    with pytest.raises(ValueError, match="1"):
        t.item()
    with pytest.raises(TypeError, match="floating"):
        Tensor(np.arange(3), requires_grad=True)
    with pytest.raises(TypeError, match="dict"):
        Tensor({"a": 1})


def test_float32_stays_float32():
    x = Tensor(np.ones((4, 3), np.float32), requires_grad=True)
    y = ((x * 0.5 + 1) / 3.0 - 2 ** x).exp().mean() * np.float32(2)
    assert y.dtype == np.float32
    y.backward()
    assert x.grad.dtype == np.float32


def test_comparisons_have_no_grad():
    x = Tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    for result in (x < 2, x <= 2, x > 2, x >= 2, x == 2, x != 2, x > np.array([0, 5, 0])):
        assert result.dtype == np.bool_ and not result.requires_grad
    np.testing.assert_array_equal((x >= 2).data, [False, True, True])
    assert len({x, x}) == 1


def test_numpy_array_on_the_left_defers_to_tensor():
    x = Tensor(np.ones(3), requires_grad=True)
    y = np.array([1.0, 2.0, 3.0]) * x + np.ones(3)
    assert isinstance(y, Tensor)
    y.sum().backward()
    np.testing.assert_allclose(x.grad, [1.0, 2.0, 3.0])


def test_gradients_accumulate_until_zeroed():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    (x * x).sum().backward()
    (x * 3).sum().backward()
    np.testing.assert_allclose(x.grad, [5.0, 7.0])
    x.grad = None
    (x * 3).sum().backward()
    np.testing.assert_allclose(x.grad, [3.0, 3.0])


def test_leaf_gradients_never_share_memory():
    a = Tensor(np.ones(3), requires_grad=True)
    b = Tensor(np.ones(3), requires_grad=True)
    c = Tensor(np.ones((3, 1)), requires_grad=True)
    seed = np.ones(3)
    (a + b + c.reshape(3)).backward(seed)
    a.grad *= 10
    np.testing.assert_allclose(b.grad, 1.0)
    np.testing.assert_allclose(c.grad, 1.0)
    np.testing.assert_allclose(seed, 1.0)


def test_backward_errors():
    x = Tensor(np.ones(3), requires_grad=True)
    with pytest.raises(RuntimeError, match="non-scalar"):
        (x * 2).backward()
    with pytest.raises(ValueError, match="shape"):
        (x * 2).backward(np.ones(4))
    with pytest.raises(RuntimeError, match="does not require grad"):
        Tensor(np.ones(3)).sum().backward()


def test_graph_is_freed_after_backward_unless_retained():
    x = Tensor(np.ones(3), requires_grad=True)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_allclose(x.grad, [4.0, 4.0, 4.0])
    with pytest.raises(RuntimeError, match="retain_graph"):
        y.backward()


def test_intermediate_buffers_are_released():
    x = Tensor(np.ones((8, 8)), requires_grad=True)
    h = (x * 2).tanh()
    ref = weakref.ref(h)
    loss = (h * h).sum()
    del h
    assert ref() is not None  # the graph holds it until backward
    loss.backward()
    assert ref() is None


def test_training_steps_do_not_grow_the_number_of_live_tensors():
    import gc

    model = nn.Sequential(nn.Linear(5, 8, seed=0), nn.ReLU(), nn.Linear(8, 3, seed=1))
    x, y = Tensor(np.ones((4, 5), np.float32)), np.array([0, 1, 2, 0])
    counts = []
    for _ in range(5):
        loss = F.cross_entropy(model(x), y)
        model.zero_grad()
        loss.backward()
        gc.collect()
        counts.append(sum(type(o) in (Tensor, nn.Parameter) for o in gc.get_objects()))
    assert counts[-1] == counts[1]


def test_no_grad_records_nothing():
    x = Tensor(np.ones(3), requires_grad=True)
    assert is_grad_enabled()
    with no_grad():
        assert not is_grad_enabled()
        y = x * 2
        with enable_grad():
            z = x * 2
    assert is_grad_enabled()
    assert not y.requires_grad and y.is_leaf
    assert z.requires_grad and not z.is_leaf


def test_grad_ready_hooks_fire_once_when_the_gradient_is_final():
    w1 = nn.Parameter(np.full((3, 3), 0.5))
    w2 = nn.Parameter(np.full((3, 3), 0.25))
    x = Tensor(np.ones((2, 3)))
    seen = []

    def hook(p):
        seen.append((p, p.grad.copy()))

    handles = [w1.register_grad_ready_hook(hook), w2.register_grad_ready_hook(hook)]
    h = x @ w1
    out = (h @ w2 + h @ w2.T + h).sum()  # w2 used twice, w1 reached by three paths
    out.backward()
    assert [p for p, _ in seen] == [w2, w1]
    for p, grad_at_hook in seen:
        np.testing.assert_array_equal(grad_at_hook, p.grad)
    seen.clear()
    out = (x @ w1 @ w2).sum()
    out.backward()
    assert [p for p, _ in seen] == [w2, w1]
    handles[0].remove()
    seen.clear()
    (x @ w1).sum().backward()
    assert seen == []


def test_hooks_fire_in_reverse_layer_order_and_see_accumulated_grads():
    model = nn.Sequential(nn.Linear(4, 6, seed=0), nn.ReLU(), nn.Linear(6, 2, seed=1))
    order = []
    for name, p in model.named_parameters():
        p.register_grad_ready_hook(lambda p, name=name: order.append(name))
    F.cross_entropy(model(Tensor(np.ones((3, 4), np.float32))), np.array([0, 1, 1])).backward()
    assert set(order) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert order.index("2.weight") < order.index("0.weight")
    assert order.index("2.bias") < order.index("0.bias")


def test_hook_may_overwrite_the_gradient():
    p = nn.Parameter(np.ones(2))

    def halve(param):
        param.grad = param.grad / 2

    p.register_grad_ready_hook(halve)
    (p * 4).sum().backward()
    np.testing.assert_allclose(p.grad, [2.0, 2.0])


def test_hooks_only_on_leaves_that_require_grad():
    x = Tensor(np.ones(2), requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf"):
        (x * 2).register_grad_ready_hook(print)
    with pytest.raises(RuntimeError, match="leaf"):
        Tensor(np.ones(2)).register_grad_ready_hook(print)


def test_matmul_error_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(4, 5\)"):
        Tensor(np.ones((2, 3))) @ Tensor(np.ones((4, 5)))


def test_functional_input_errors():
    x = Tensor(np.ones((2, 3)))
    with pytest.raises(TypeError, match="integer"):
        F.cross_entropy(x, np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="labels shape"):
        F.cross_entropy(x, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        F.cross_entropy(x, np.array([0, 3]))
    with pytest.raises(ValueError, match="reduction"):
        F.cross_entropy(x, np.array([0, 1]), reduction="avg")
    with pytest.raises(ValueError, match="x must be 4-D"):
        F.conv2d(Tensor(np.ones((3, 5, 5))), Tensor(np.ones((2, 3, 3, 3))))
    with pytest.raises(ValueError, match="weight must be 4-D"):
        F.conv2d(Tensor(np.ones((1, 3, 5, 5))), Tensor(np.ones((2, 3, 3))))
    with pytest.raises(ValueError, match="channels"):
        F.conv2d(Tensor(np.ones((1, 2, 5, 5))), Tensor(np.ones((2, 3, 3, 3))))
    with pytest.raises(ValueError, match="input shape"):
        F.linear(x, Tensor(np.ones((4, 4))))
    with pytest.raises(ValueError, match="target shape"):
        F.mse_loss(x, np.ones((3, 2)))
    with pytest.raises(ValueError, match="kernel_size"):
        F.max_pool2d(Tensor(np.ones((1, 1, 2, 2))), 3)
    with pytest.raises(ValueError, match="p must"):
        F.dropout(x, 1.5)


def test_dropout_scales_kept_values_and_is_identity_in_eval():
    x = Tensor(np.ones((200, 50), np.float32))
    y = F.dropout(x, 0.25, rng=np.random.default_rng(0)).data
    kept = y != 0
    np.testing.assert_allclose(y[kept], 1 / 0.75, rtol=1e-6)
    assert 0.7 < kept.mean() < 0.8
    assert F.dropout(x, 0.25, training=False) is x
    assert not F.dropout(x, 1.0).data.any()


@pytest.mark.parametrize("device", DEVICES)
def test_to_device_round_trip_is_differentiable(device):
    x = Tensor(np.arange(3.0), requires_grad=True)
    y = x.to(device)
    assert y.device == device
    (y * y).sum().backward()
    assert isinstance(x.grad, np.ndarray)
    np.testing.assert_allclose(x.grad, [0.0, 2.0, 4.0])
    with pytest.raises(ValueError, match="device"):
        x.to("tpu")


@pytest.mark.skipif(cupy_module() is not None, reason="a GPU is present")
def test_to_gpu_without_a_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="GPU"):
        Tensor(np.ones(2)).to("gpu")
