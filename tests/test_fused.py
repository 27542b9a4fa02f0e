"""The fused transformer kernels (mpdl.autograd.fused) and the packed attention: each host kernel
against the array expressions a GPU runs, against PyTorch and against numerical gradients, in
float32 and float64; the float32 exp and erf against the C library; NaN and infinities carried
through; and a whole GPT's gradients the same on both paths."""

import math

import numpy as np
import pytest

import mpdl.autograd.functional as F
from mpdl.autograd import Tensor, fused, gradcheck, nn, optim
from mpdl.autograd.linear_gelu import linear_gelu
from mpdl.backend import standin
from mpdl.models import attention
from mpdl.models.attention import packed_attention
from mpdl.models.gpt import GPT

#: float32 kernels: a few units in the last place of the array path (exp and erf are polynomials)
TOL = {np.float32: dict(rtol=2e-5, atol=2e-6), np.float64: dict(rtol=1e-12, atol=1e-13)}
DTYPES = [np.float32, np.float64]
SHAPES = [(1, 1), (3, 7), (5, 128), (2, 3, 33)]


def _random(shape, dtype, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def _both_paths(fn, *args):
    """fn(*args) on the host kernels and on the array path."""
    host = fn(*args)
    with fused.array_path():
        array = fn(*args)
    return host, array


def _assert_close(host, array, dtype, scale=1.0):
    """Equal within TOL, the absolute tolerance times ``scale`` (the size of the terms that
    cancel in an exact zero)."""
    host = host if isinstance(host, tuple) else (host,)
    array = array if isinstance(array, tuple) else (array,)
    tol = TOL[dtype]
    for h, a in zip(host, array, strict=True):
        assert h.dtype == a.dtype == dtype
        np.testing.assert_allclose(h, a, rtol=tol["rtol"], atol=tol["atol"] * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_kernels_match_the_array_path(shape, dtype):
    x = _random(shape, dtype, scale=3.0).reshape(-1, shape[-1]) + 2.0
    w, b = _random(shape[-1], dtype, 1), _random(shape[-1], dtype, 2)
    g = _random(x.shape, dtype, 3)
    host, array = _both_paths(fused.layer_norm, x, w, b, 1e-5)
    _assert_close(host, array, dtype)
    _, mean, rstd = host
    _assert_close(*_both_paths(fused.layer_norm_backward, g, x, w, mean, rstd), dtype,
                  scale=float(rstd.max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_kernels_match_the_array_path(shape, dtype):
    x, g = _random(shape, dtype, scale=3.0), _random(shape, dtype, 1)
    _assert_close(*_both_paths(fused.gelu, x), dtype)
    _assert_close(*_both_paths(fused.gelu_backward, g, x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_gelu_kernels_match_the_array_path(shape, dtype):
    h = _random(shape, dtype, scale=3.0).reshape(-1, shape[-1])
    b, g = _random(shape[-1], dtype, 1), _random(h.shape, dtype, 2)
    _assert_close(*_both_paths(fused.bias_gelu, h, b), dtype)
    _assert_close(*_both_paths(fused.bias_gelu_backward, g, h, b), dtype, scale=len(h))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("array_path", [False, True], ids=["kernels", "array_path"])
def test_linear_gelu_gives_the_bits_of_linear_then_gelu(array_path, dtype):
    """One node, the same values and gradients as ``gelu(linear(x, w, b))``, bit for bit."""
    x, w, b = _random((3, 5, 16), dtype), _random((24, 16), dtype, 1), _random(24, dtype, 2)
    g = _random((3, 5, 24), dtype, 3)
    results = []
    for fn in (linear_gelu, lambda *args: F.gelu(F.linear(*args))):
        args = [Tensor(a.copy(), requires_grad=True) for a in (x, w, b)]
        if array_path:
            with fused.array_path():
                out = fn(*args)
                out.backward(g)
        else:
            out = fn(*args)
            out.backward(g)
        results.append([out.data] + [a.grad for a in args])
    fused_node, composition = results
    for got, want in zip(fused_node, composition, strict=True):
        assert got.dtype == want.dtype == dtype
        np.testing.assert_array_equal(got, want)


def test_linear_gelu_rejects_bad_input():
    layer = nn.Linear(4, 6, seed=0)
    with pytest.raises(ValueError, match="activation must be None or 'gelu'"):
        layer(Tensor(np.ones((2, 4), np.float32)), activation="relu")
    with pytest.raises(ValueError, match="bias"):
        linear_gelu(Tensor(np.ones((2, 4))), Tensor(np.ones((6, 4))), Tensor(np.ones(5)))
    with pytest.raises(ValueError, match="does not fit weight"):
        linear_gelu(Tensor(np.ones((2, 3))), Tensor(np.ones((6, 4))), Tensor(np.ones(6)))
    unbiased = nn.Linear(4, 6, bias=False, seed=0)
    x = Tensor(_random((2, 4), np.float32))
    np.testing.assert_array_equal(unbiased(x, activation="gelu").data,
                                  F.gelu(unbiased(x)).data)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 5, 5), (3, 4, 9), (2, 2, 7, 3), (1, 19, 37)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [0.25, -1.5])
def test_softmax_kernels_match_the_array_path(shape, dtype, causal, scale):
    scores, g = _random(shape, dtype, scale=4.0), _random(shape, dtype, 1)
    host, array = _both_paths(lambda: fused.softmax_(scores.copy(), scale, causal))
    _assert_close(host, array, dtype)
    _assert_close(*_both_paths(lambda: fused.softmax_backward_(g.copy(), host, scale, causal)),
                  dtype)
    if causal:  # row i sees entries 0..i only
        assert not np.triu(host.reshape(-1, *shape[-2:]), 1).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, classes", [(1, 1), (6, 5), (17, 65)])
def test_cross_entropy_kernels_match_the_array_path(rows, classes, dtype):
    logits = _random((rows, classes), dtype, scale=5.0)
    labels = np.random.default_rng(1).integers(0, classes, rows)
    keep = np.arange(rows) % 3 != 1
    for kept in (None, keep):
        host, array = _both_paths(fused.cross_entropy, logits, labels, kept)
        _assert_close(host, array, dtype)
        scale = _random(rows, dtype, 2)
        _assert_close(*_both_paths(fused.cross_entropy_backward, logits, labels, host[1], scale),
                      dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_finds_the_row_maximum_at_every_position(dtype):
    """The kernel's row maximum runs in eight lanes and a remainder: a large score at each
    position of a 21-long row gives the array path's softmax, and a NaN there a NaN row."""
    n = 21
    scores = np.tile(np.linspace(-1, 1, n, dtype=dtype), (n, 1))
    scores[np.arange(n), np.arange(n)] = 2000.0  # a wrong maximum overflows exp
    for scale in (0.5, -0.5):
        _assert_close(*_both_paths(lambda: fused.softmax_(scores[None].copy(), scale, False)),
                      dtype)
    scores[np.arange(n), np.arange(n)] = np.nan
    assert np.isnan(fused.softmax_(scores[None].copy(), 1.0, False)).all()


def test_float32_exp_and_erf_against_the_c_library():
    x32 = np.concatenate([np.linspace(-110, 100, 200_001), [0.0, -0.0, 88.5, -87.5]]).astype(
        np.float32)
    x = x32.astype(np.float64)
    # exp through the softmax of rows [x, 0]: the first probability is 1 / (1 + exp(-x))
    p = fused.softmax_(np.stack([x32, np.zeros_like(x32)], axis=1)[None].copy(), 1.0, False)
    np.testing.assert_allclose(p[0, :, 0], 1 / (1 + np.exp(-x)), rtol=1e-6, atol=1e-30)
    # erf through gelu: x·(1 + erf(x/√2))/2
    erf = np.array([math.erf(v / math.sqrt(2)) for v in x])
    np.testing.assert_allclose(fused.gelu(x32), x * (1 + erf) / 2, rtol=2e-6, atol=1e-6)


SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30, 3.0, -2.0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_infinity_are_carried_through_as_on_the_array_path(dtype):
    x = np.array([[v, 1.0, -0.5] for v in SPECIAL], dtype)
    g = np.ones_like(x)
    np_errors = np.geterr()
    np.seterr(all="ignore")  # the array path warns of the NaN it makes
    for name, fn in {
        "gelu": lambda: fused.gelu(x),
        "gelu_backward": lambda: fused.gelu_backward(g, x),
        "layer_norm": lambda: fused.layer_norm(x, np.ones(3, dtype), np.zeros(3, dtype), 1e-5),
        "softmax": lambda: fused.softmax_(x[None].copy(), 1.0, False),
        "softmax_causal": lambda: np.tril(fused.softmax_(x[None, 3:6].copy(), 0.5, True)),
        "cross_entropy": lambda: fused.cross_entropy(x, np.zeros(len(x), np.int64), None),
    }.items():
        host, array = _both_paths(fn)
        host = host if isinstance(host, tuple) else (host,)
        array = array if isinstance(array, tuple) else (array,)
        for h, a in zip(host, array, strict=True):
            np.testing.assert_allclose(h, a, err_msg=name, **TOL[dtype])
    np.seterr(**np_errors)
    assert np.isnan(fused.gelu(x)[0, 0]) and np.isnan(fused.softmax_(x[None].copy(), 1.0,
                                                                      False)[0, 0]).all()
    # the entries a causal mask hides are 0 on the host even in a row with a NaN
    p = fused.softmax_(x[None, :3].copy(), 0.5, True)[0]
    assert np.isnan(p[0, 0]) and not np.triu(p, 1).any()


def test_the_kernels_are_deterministic():
    x = _random((64, 96), np.float32, scale=3.0)
    for fn in (fused.gelu, lambda a: fused.softmax_(a.copy(), 0.3, True),
               lambda a: fused.layer_norm(a, np.ones(96, np.float32), np.zeros(96, np.float32),
                                          1e-5)[0]):
        assert fn(x).tobytes() == fn(x).tobytes()


def test_device_arrays_take_the_array_path():
    """CuPy (here the stand-in device array) never reaches a host kernel; NumPy arrays of a
    float dtype do, unless the array path is forced; other dtypes and mixed dtypes do not."""
    device = standin.asarray(np.ones((2, 3), np.float32))
    host32, host64 = np.ones((2, 3), np.float32), np.ones((2, 3))
    assert not fused.kernels_apply(device)
    assert fused.kernels_apply(host32) and fused.kernels_apply(host64, host64)
    assert not fused.kernels_apply(host32, host64)
    assert not fused.kernels_apply(host32.astype(np.float16))
    with fused.array_path():
        assert not fused.kernels_apply(host32)


def _gpt_ops():
    """(name, function, inputs) of every op the GPT runs through a fused kernel, in float64."""
    r = np.random.default_rng(4)
    labels = np.array([[1, -100, 3, 6], [0, 0, -100, 2]])
    return [
        ("layer_norm", lambda x, w, b: F.layer_norm(x, 6, w, b), r.standard_normal((2, 5, 6)),
         r.standard_normal(6), r.standard_normal(6)),
        ("layer_norm_2d", lambda x: F.layer_norm(x, (5, 6)), r.standard_normal((2, 5, 6))),
        ("gelu", F.gelu, r.standard_normal((3, 7)) * 2),
        ("linear_gelu", linear_gelu, r.standard_normal((2, 3, 4)), r.standard_normal((5, 4)),
         r.standard_normal(5)),
        ("cross_entropy", lambda x: F.cross_entropy(x, labels), r.standard_normal((2, 4, 7))),
        ("packed_attention", lambda qkv: packed_attention(qkv), r.standard_normal((2, 5, 3, 2, 4))),
        ("packed_attention_full", lambda qkv: packed_attention(qkv, is_causal=False, scale=0.7),
         r.standard_normal((2, 4, 3, 3, 2))),
    ]


@pytest.mark.parametrize("array_path", [False, True], ids=["kernels", "array_path"])
def test_gradcheck_of_the_fused_ops(array_path, monkeypatch):
    monkeypatch.setattr(attention, "CAUSAL_BLOCK", 2)  # the causal products in blocks
    monkeypatch.setattr(attention, "CHUNK_BYTES", 1)  # one batch element at a time
    for name, fn, *inputs in _gpt_ops():
        if array_path:
            with fused.array_path():
                assert gradcheck(fn, *inputs), name
        else:
            assert gradcheck(fn, *inputs), name


@pytest.mark.parametrize("array_path", [False, True], ids=["kernels", "array_path"])
@pytest.mark.parametrize("chunk", [None, 1, 2], ids=["whole_batch", "chunk1", "chunk2"])
@pytest.mark.parametrize("block", [64, 2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_attention_equals_attention_of_the_split_heads(causal, block, chunk, array_path,
                                                              monkeypatch):
    """Also with causal blocks of 2 and 3 query rows over 7 positions (the last block short), and
    with the batch of 3 in chunks of 1 and 2 elements (the last chunk short)."""
    monkeypatch.setattr(attention, "CAUSAL_BLOCK", block)
    if chunk is not None:  # the scores of one element: 2 heads x 7 x 7 float64
        monkeypatch.setattr(attention, "CHUNK_BYTES", chunk * 2 * 7 * 7 * 8)
    qkv = np.random.default_rng(5).standard_normal((3, 7, 3, 2, 4))
    ours = Tensor(qkv.copy(), requires_grad=True)
    split = Tensor(qkv.copy(), requires_grad=True)
    with fused.array_path() if array_path else _nothing():
        out = packed_attention(ours, is_causal=causal)
    heads = split.transpose(2, 0, 3, 1, 4)
    ref = F.scaled_dot_product_attention(heads[0], heads[1], heads[2], is_causal=causal)
    np.testing.assert_allclose(out.data, ref.transpose(0, 2, 1, 3).data, rtol=1e-13, atol=1e-14)
    g = np.random.default_rng(6).standard_normal(out.shape)
    with fused.array_path() if array_path else _nothing():
        out.backward(g)
    ref.transpose(0, 2, 1, 3).backward(g)
    np.testing.assert_allclose(ours.grad, split.grad, rtol=1e-12, atol=1e-13)


def test_packed_attention_rejects_bad_input():
    with pytest.raises(ValueError, match="qkv must be"):
        packed_attention(Tensor(np.zeros((2, 3, 4, 2, 2))))
    with pytest.raises(TypeError, match="qkv must be a Tensor"):
        packed_attention(np.zeros((2, 3, 3, 2, 2)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpt_gradients_are_the_same_on_the_kernels_and_the_array_path(dtype):
    """The whole GPT (every fused op, causal attention, tied head, ignored labels): the loss and
    every parameter's gradient agree between the host kernels and the array expressions."""
    idx = np.random.default_rng(7).integers(0, 11, (3, 8))
    targets = np.random.default_rng(8).integers(0, 11, (3, 8))
    targets[0, :3] = -100
    results = []
    for forced in (False, True):
        model = GPT(11, 8, 2, 2, 16, seed=3, dtype=dtype)
        for p in model.parameters():  # LayerNorm and biases away from their trivial init
            p.data += np.random.default_rng(9).normal(0, 0.1, p.shape).astype(dtype)
        with fused.array_path() if forced else _nothing():
            loss = F.cross_entropy(model(idx), targets)
            loss.backward()
        results.append((loss.data, {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), (loss_ref, grads_ref) = results
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(loss, loss_ref, **tol)
    for name, g in grads.items():
        assert g.dtype == dtype
        np.testing.assert_allclose(g, grads_ref[name], err_msg=name, **tol)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_gpt_kernels_match_torch_in_float32():
    """A float32 GPT step on the host kernels against PyTorch's float32 step (same weights)."""
    torch = pytest.importorskip("torch")
    from tests.test_autograd_transformer import _torch_gpt

    model = GPT(13, 8, 2, 2, 16, seed=1, dtype=np.float32)
    for p in model.parameters():
        p.data += np.random.default_rng(2).normal(0, 0.1, p.shape).astype(np.float32)
    theirs = _torch_gpt(torch, model)
    idx = np.random.default_rng(3).integers(0, 13, (3, 8))
    targets = np.random.default_rng(4).integers(0, 13, (3, 8))
    logits = model(idx)
    theirs_logits = theirs(torch.tensor(idx))
    np.testing.assert_allclose(logits.data, theirs_logits.detach().numpy(), rtol=1e-4, atol=1e-5)
    F.cross_entropy(logits, targets).backward()
    torch.nn.functional.cross_entropy(theirs_logits.reshape(-1, 13),
                                      torch.tensor(targets).reshape(-1)).backward()
    theirs_params = dict(theirs.named_parameters())
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, theirs_params[name].grad.numpy(), rtol=2e-3,
                                   atol=2e-5, err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["adam", "adam_l2", "adamw"])
def test_adam_kernel_gives_the_bits_of_the_array_path(dtype, kind):
    """Three steps of Adam, Adam with L2 weight decay and AdamW on a matrix and a vector: the
    parameters and moments are bitwise those of the array expressions."""
    make = {"adam": lambda ps: optim.Adam(ps, lr=3e-3, betas=(0.8, 0.95), eps=1e-6),
            "adam_l2": lambda ps: optim.Adam(ps, lr=1e-2, weight_decay=0.1),
            "adamw": lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=0.1)}[kind]
    results = []
    for forced in (False, True):
        params = [Tensor(_random(shape, dtype, i), requires_grad=True)
                  for i, shape in enumerate([(7, 5), (5,)])]
        opt = make(params)
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = _random(p.shape, dtype, 10 * step + i, scale=10.0 ** (i - step))
            with fused.array_path() if forced else _nothing():
                opt.step()
        results.append([p.data for p in params] + [s[k] for s in opt.state.values()
                                                    for k in ("exp_avg", "exp_avg_sq")])
    for host, array in zip(*results, strict=True):
        assert host.dtype == dtype
        np.testing.assert_array_equal(host, array)
        assert host.tobytes() == array.tobytes()
