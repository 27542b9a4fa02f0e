"""Small datasets shipped with mpdl.

``load_digits`` reads the UCI Optical Recognition of Handwritten Digits data (the 8×8 test
set), by E. Alpaydin and C. Kaynak, UCI Machine Learning Repository, licensed CC BY 4.0
(https://doi.org/10.24432/C50P49): 1797 grey-scale images with pixel values 0..16.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

_DATA = Path(__file__).resolve().parent / "data"


def load_digits(test_fraction: float = 0.2, seed: int = 0
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The UCI handwritten digits as (x_train, y_train, x_test, y_test).

    Images are flat float32 64-vectors scaled to [0, 1]; labels are int64 in 0..9. The split is
    stratified: each class contributes ``round(test_fraction × its count)`` images to the test
    set, chosen by a generator seeded with ``seed``; both sets are then shuffled.
    """
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"load_digits: test_fraction must lie in [0, 1), not {test_fraction!r}")
    with np.load(_DATA / "digits.npz") as archive:
        images, labels = archive["images"], archive["labels"]
    x = images.reshape(len(images), -1).astype(np.float32) / np.float32(16.0)
    y = labels.astype(np.int64)
    rng = np.random.default_rng(seed)
    test_parts, train_parts = [], []
    for c in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == c))
        n_test = int(round(test_fraction * len(members)))
        test_parts.append(members[:n_test])
        train_parts.append(members[n_test:])
    train = rng.permutation(np.concatenate(train_parts))
    test = rng.permutation(np.concatenate(test_parts))
    return x[train], y[train], x[test], y[test]


class DatasetError(ValueError):
    """A data file that is missing, unreadable or not in the expected format."""


_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
              0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}

#: the standard MNIST file names (each may also end in .gz)
MNIST_FILES = {"x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
               "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte"}


def read_idx(path: str | Path) -> np.ndarray:
    """An array from an IDX file (LeCun's MNIST format), gzipped or not."""
    import gzip  # noqa: PLC0415

    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError) as exc:
        raise DatasetError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise DatasetError(f"{path}: not an IDX file (bad magic number {raw[:4].hex()})")
    dtype, ndim = np.dtype(_IDX_TYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(f"{path}: truncated IDX header")
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if len(raw) != expected:
        raise DatasetError(f"{path}: IDX header says shape {shape} ({expected} bytes) but the "
                           f"file has {len(raw)} bytes")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _find_idx(directory: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"),
                 stem.replace("-idx", ".idx") + ".gz"):
        if (directory / name).is_file():
            return directory / name
    raise DatasetError(f"{directory}: no {stem}[.gz] (MNIST needs {', '.join(MNIST_FILES.values())}, "
                       f"gzipped or not)")


def load_mnist(path: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """MNIST as (x_train, y_train, x_test, y_test): images float32 (N, 1, 28, 28) in [0, 1],
    labels int64.

    `path` is a directory with the four standard IDX files (gzipped or not) or an .npz with
    arrays x_train, y_train, x_test, y_test (the layout of Keras' mnist.npz). Nothing is
    downloaded.
    """
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such file or directory (give the folder with the MNIST "
                           f"IDX files or an .npz with x_train, y_train, x_test, y_test)")
    if path.is_dir():
        arrays = {key: read_idx(_find_idx(path, stem)) for key, stem in MNIST_FILES.items()}
    else:
        try:
            with np.load(path, allow_pickle=False) as archive:
                missing = [k for k in MNIST_FILES if k not in archive.files]
                if missing:
                    raise DatasetError(f"{path}: missing arrays {missing} (expected x_train, "
                                       f"y_train, x_test, y_test)")
                arrays = {k: archive[k] for k in MNIST_FILES}
        except DatasetError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unreadable archive gets the same message
            raise DatasetError(f"{path}: not a readable .npz archive ({exc})") from None
    return (*_images_and_labels(path, arrays, "train"), *_images_and_labels(path, arrays, "test"))


def _images_and_labels(path: Path, arrays: dict, split: str) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(arrays[f"x_{split}"]), np.asarray(arrays[f"y_{split}"])
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4 or y.ndim != 1 or len(x) != len(y) or len(x) == 0:
        raise DatasetError(f"{path}: {split} images of shape {x.shape} and labels of shape "
                           f"{y.shape} do not form a dataset (expected (N, 28, 28) and (N,))")
    scale = np.float32(255.0) if x.dtype.kind in "ui" or x.max() > 1.0 else np.float32(1.0)
    return x.astype(np.float32) / scale, y.astype(np.int64)


#: image shapes of the synthetic datasets
SYNTHETIC_SHAPES = {"mnist": (1, 28, 28), "cifar": (3, 32, 32)}


def synthetic(shape: str = "mnist", n_train: int = 1024, n_test: int = 256, classes: int = 10,
              seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A learnable MNIST- or CIFAR-shaped dataset of any size, for benchmarks: each class is a
    random template plus Gaussian noise. Returns (x_train, y_train, x_test, y_test)."""
    if shape not in SYNTHETIC_SHAPES:
        raise ValueError(f"shape: expected one of {', '.join(SYNTHETIC_SHAPES)}, got {shape!r}")
    if n_train < 1 or n_test < 0 or classes < 2:
        raise ValueError(f"synthetic: expected n_train >= 1, n_test >= 0, classes >= 2, got "
                         f"{n_train}, {n_test}, {classes}")
    dims = SYNTHETIC_SHAPES[shape]
    rng = np.random.default_rng(seed)
    templates = rng.uniform(0.0, 1.0, (classes, *dims)).astype(np.float32)
    y = rng.integers(0, classes, n_train + n_test)
    x = templates[y] + rng.normal(0.0, 0.5, (n_train + n_test, *dims)).astype(np.float32)
    return x[:n_train], y[:n_train].astype(np.int64), x[n_train:], y[n_train:].astype(np.int64)
