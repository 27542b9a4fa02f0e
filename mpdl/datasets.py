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
