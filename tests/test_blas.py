"""mpdl.blas: the layers' float32 products through a CBLAS library called with ctypes.

The binding is checked on every machine against the OpenBLAS NumPy's wheel carries (its CBLAS
entry point runs the kernels NumPy's ``@`` runs, so the results must agree bit for bit), over
random layouts: transposed views, strided slices, size-1 axes, stacks with interleaved results.
MKL, an optional extra, is checked the same way (to float32 rounding) where it is installed.
"""

import numpy as np
import pytest

import mpdl.autograd.functional as F
from mpdl import blas, settings
from mpdl.autograd import Tensor
from mpdl.models.gpt import GPT

OPENBLAS = blas.numpy_openblas()
MKL = blas.mkl()
needs_openblas = pytest.mark.skipif(OPENBLAS is None, reason="NumPy was built against a BLAS "
                                                             "other than its wheel's OpenBLAS")
needs_mkl = pytest.mark.skipif(MKL is None, reason="MKL is an optional extra: pip install mkl")


@pytest.fixture(params=["openblas", "mkl"])
def library(request):
    """Each CBLAS binding: NumPy's OpenBLAS, and MKL where it is installed."""
    found = {"openblas": OPENBLAS, "mkl": MKL}[request.param]
    if found is None:
        pytest.skip(f"{request.param} is not installed here")
    return found


@pytest.fixture
def library_in_use():
    """Restores the library the products went to before the test."""
    before = blas.use(blas.selected())
    yield
    blas.use(before)


def random_view(rng, rows, cols):
    """A float32 (rows, cols) array in one of several memory layouts."""
    kind = rng.integers(5)
    if kind == 0:
        return rng.standard_normal((rows, cols)).astype(np.float32)
    if kind == 1:  # a transposed array
        return rng.standard_normal((cols, rows)).astype(np.float32).T
    if kind == 2:  # every other row of a wider array, shifted
        return rng.standard_normal((2 * rows + 1, cols + 3)).astype(np.float32)[1::2, 2:cols + 2]
    if kind == 3:  # columns of a transposed wider array
        return rng.standard_normal((cols + 2, rows + 5)).astype(np.float32)[1:cols + 1, 3:].T[:rows]
    return np.asfortranarray(rng.standard_normal((rows, cols)).astype(np.float32))[:, ::1]


def check_same(got, want, exact):
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("seed", range(40))
def test_matmul_matches_numpy_on_random_layouts(library, seed):
    rng = np.random.default_rng(seed)
    m, k, n = (int(rng.choice([1, 2, 3, 7, 16, 33, 64])) for _ in range(3))
    a, b = random_view(rng, m, k), random_view(rng, k, n)
    got = library.matmul(a, b)
    assert got is not None, (a.strides, b.strides)
    assert got.shape == (m, n) and got.dtype == np.float32 and got.flags.c_contiguous
    # a product with one row or column is a matrix-vector product to NumPy (gemv, other bits)
    check_same(got, a @ b, exact=library is OPENBLAS and m > 1 and n > 1)


@needs_openblas
def test_matmul_leaves_what_blas_cannot_take_to_numpy():
    rng = np.random.default_rng(1)
    a32 = rng.standard_normal((6, 5)).astype(np.float32)
    b32 = rng.standard_normal((5, 4)).astype(np.float32)
    for a, b in [(a32.astype(np.float64), b32.astype(np.float64)),  # another dtype
                 (a32[:, ::2], b32[:3]),                            # columns not adjacent
                 (a32[:, :0], b32[:0]),                             # an empty inner dimension
                 (a32[None], b32)]:                                 # a stack
        assert OPENBLAS.matmul(a, b) is None
    before = blas.use(OPENBLAS)
    try:
        for a, b in [(a32.astype(np.float64), b32.astype(np.float64)), (a32[:, ::2], b32[:3]),
                     (a32[:, :0], b32[:0]), (a32[None], b32), (a32[0], b32)]:
            np.testing.assert_array_equal(blas.matmul(a, b), a @ b)
    finally:
        blas.use(before)


def random_stack(rng, batch, rows, cols):
    """A float32 stack of (rows, cols) matrices in one of several layouts."""
    kind = rng.integers(4)
    if kind == 0:
        return rng.standard_normal(batch + (rows, cols)).astype(np.float32)
    if kind == 1:  # transposed matrices
        return rng.standard_normal(batch + (cols, rows)).astype(np.float32).swapaxes(-1, -2)
    if kind == 2:  # the matrices' rows alternate in memory, as attention's heads do in (B, T, H, hd)
        return interleaved(rng.standard_normal, batch, rows, cols)
    return np.broadcast_to(random_view(rng, rows, cols), batch + (rows, cols))  # one matrix, repeated


def interleaved(fill, batch, rows, cols):
    return fill(batch[:-1] + (rows, batch[-1], cols)).astype(np.float32).swapaxes(-2, -3)


@pytest.mark.parametrize("seed", range(30))
def test_matmul_into_matches_numpy_on_random_stacks(library, seed):
    rng = np.random.default_rng(100 + seed)
    batch = tuple(int(x) for x in rng.integers(1, 5, size=rng.integers(1, 3)))
    m, k, n = (int(rng.choice([17, 40, 64, 96])) for _ in range(3))
    a, b = random_stack(rng, batch, m, k), random_stack(rng, batch, k, n)
    nan = lambda shape: np.full(shape, np.nan)  # noqa: E731
    out = interleaved(nan, batch, m, n) if rng.integers(2) else nan(batch + (m, n)).astype(np.float32)
    assert library.matmul_into(a, b, out)
    check_same(out, np.matmul(a, b), exact=library is OPENBLAS)


@needs_mkl
def test_mkl_batches_along_an_axis_whose_results_do_not_interleave():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 40, 3, 32)).astype(np.float32).transpose(0, 2, 1, 3)  # (B, H, T, hd)
    k = rng.standard_normal((2, 40, 3, 32)).astype(np.float32).transpose(0, 2, 1, 3)
    scores = np.full((2, 3, 40, 40), np.nan, np.float32)
    out = np.full((2, 40, 3, 32), np.nan, np.float32).transpose(0, 2, 1, 3)
    matrix_bytes = 40 * 3 * 32 * 4  # rows of out are H·hd apart: the heads interleave, the batch not
    assert MKL._batch_axis(scores, k, out, matrix_bytes) == 0
    assert MKL._batch_axis(q, k.swapaxes(-1, -2), scores, 40 * 40 * 4) in (0, 1)
    assert MKL.matmul_into(q, k.swapaxes(-1, -2), scores)
    assert MKL.matmul_into(scores, k, out)
    check_same(scores, q @ k.swapaxes(-1, -2), exact=False)
    check_same(out, scores @ k, exact=False)


@needs_openblas
def test_a_gpt_step_through_the_binding_is_numpys_bit_for_bit(library_in_use):
    """Every product of a GPT train step (linear layers forward and backward, the tied head,
    attention's blocks) through the binding: the same loss and gradients, bit for bit."""
    def loss_and_grads(library):
        blas.use(library)
        model = GPT(11, 24, n_layer=2, n_head=2, n_embd=64, seed=0, dtype=np.float32)
        rng = np.random.default_rng(0)
        idx, targets = rng.integers(0, 11, (3, 24)), rng.integers(0, 11, (3, 24))
        loss = F.cross_entropy(model(Tensor(idx)), targets)
        loss.backward()
        return float(loss.data), {name: p.grad.copy() for name, p in model.named_parameters()}

    want_loss, want = loss_and_grads(None)
    got_loss, got = loss_and_grads(OPENBLAS)
    assert got_loss == want_loss
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    if MKL is not None:
        mkl_loss, mkl = loss_and_grads(MKL)
        assert mkl_loss == pytest.approx(want_loss, rel=1e-5)
        for name in want:
            np.testing.assert_allclose(mkl[name], want[name], rtol=1e-3,
                                       atol=1e-4 * np.abs(want[name]).max(), err_msg=name)


def test_the_setting_chooses_the_library(monkeypatch, library_in_use):
    monkeypatch.setattr(blas, "_library", blas._UNCHOSEN)
    previous = settings.use(settings.Settings(blas="numpy"))
    try:
        assert blas.selected() is None and blas.describe() == "numpy"
        monkeypatch.setattr(blas, "_library", blas._UNCHOSEN)
        monkeypatch.setattr(blas, "mkl", lambda: None)
        settings.use(settings.Settings(blas="mkl"))
        with pytest.raises(ValueError, match="MPDL_BLAS=mkl"):
            blas.selected()
        monkeypatch.setattr(blas, "_library", blas._UNCHOSEN)
        settings.use(settings.Settings(blas="auto"))
        assert blas.selected() is None  # auto without MKL: NumPy
    finally:
        settings.use(previous)


@pytest.mark.parametrize("threads, chosen", [(1, "mkl"), (2, "numpy")])
def test_auto_takes_mkl_only_where_numpys_blas_runs_one_thread(threads, chosen, monkeypatch,
                                                              library_in_use):
    """MKL runs one thread: auto leaves the products to NumPy's BLAS where that may use several
    cores (one process on the machine), and takes MKL (a stand-in here) where it runs one thread
    (ranks filling the cores); numpy_blas_threads follows threadpoolctl's limits."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1, user_api="blas"):
        assert blas.numpy_blas_threads() == 1
    stand_in = object()
    monkeypatch.setattr(blas, "mkl", lambda: stand_in)
    monkeypatch.setattr(blas, "numpy_blas_threads", lambda: threads)
    monkeypatch.setattr(blas, "_library", blas._UNCHOSEN)
    previous = settings.use(settings.Settings(blas="auto"))
    try:
        assert (blas.selected() is stand_in) == (chosen == "mkl")
        monkeypatch.setattr(blas, "_library", blas._UNCHOSEN)
        settings.use(settings.Settings(blas="mkl"))
        assert blas.selected() is stand_in  # asked for by name: MKL whatever the threads
    finally:
        settings.use(previous)


def test_a_bad_setting_names_the_variable():
    with pytest.raises(ValueError, match="MPDL_BLAS: expected auto, mkl or numpy"):
        settings.Settings.from_environment({"MPDL_BLAS": "openblas"})
    assert settings.Settings.from_environment({"MPDL_BLAS": "NumPy"}).blas == "numpy"
