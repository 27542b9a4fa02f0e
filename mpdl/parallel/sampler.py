"""Which samples each rank trains on, so that p ranks follow the trajectory of one.

The sampler works on global batches. Each epoch, the sample order is a permutation drawn from a
generator seeded with (seed, epoch) — the same on every rank and for every number of ranks — and
is cut into consecutive global batches of `global_batch_size` samples. Each global batch is then
split into contiguous per-rank slices in rank order: with B samples and p ranks, the first B % p
ranks get ⌈B/p⌉ samples and the others ⌊B/p⌋ (numpy.array_split's rule; a rank may get none when
B < p). Weighting each rank's mean-loss gradient by its slice size / B before summing
(`DistributedDataParallel.set_local_batch`) then gives exactly the gradient of the global batch,
so p ranks with global batch B follow one rank with batch B, up to float round-off.

When the dataset size is not a multiple of B, the last global batch of an epoch is short:
- drop_last=True drops it;
- drop_last=False, pad=False (default) keeps it as a smaller global batch, split by the same rule;
- drop_last=False, pad=True fills it up to B with samples from the start of the epoch's order
  (those samples are seen twice in that epoch), so every step has exactly B samples.

With `atoms` (deterministic training, `mpdl.parallel.deterministic`), each global batch is first
cut into that many contiguous atoms by the same rule, and rank r gets the atoms of block r of
them: a rank always holds whole atoms, and the atoms are the same on any number of ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

# the slices of a global batch are the collectives' blocks: numpy.array_split's rule
from mpdl.collectives.ops import block_bounds as split_bounds


class DistributedSampler:
    """Global batches of a dataset of `dataset_size` samples, and this rank's slice of each.

    Iterating yields (local_indices, global_batch) per step: the sample indices of this rank's
    slice and the number of samples in the whole global batch.
    """

    def __init__(self, dataset_size: int, global_batch_size: int, rank: int = 0,
                 num_replicas: int = 1, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, pad: bool = False, atoms: int = 0) -> None:
        for name, value, low in (("dataset_size", dataset_size, 1),
                                 ("global_batch_size", global_batch_size, 1),
                                 ("num_replicas", num_replicas, 1)):
            if not isinstance(value, int | np.integer) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank: expected a rank in [0, {num_replicas}), got {rank!r}")
        if drop_last and global_batch_size > dataset_size:
            raise ValueError(f"global_batch_size: {global_batch_size} is larger than the dataset "
                             f"({dataset_size} samples) and drop_last=True leaves no batch")
        self.dataset_size = int(dataset_size)
        self.global_batch_size = int(global_batch_size)
        self.rank, self.num_replicas = int(rank), int(num_replicas)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.drop_last, self.pad = bool(drop_last), bool(pad)
        if not isinstance(atoms, int | np.integer) or atoms < 0:
            raise ValueError(f"atoms: expected an integer >= 0, got {atoms!r}")
        self.atoms = int(atoms)
        #: the sample indices of the whole global batch last handed out
        self.batch = np.empty(0, dtype=np.int64)
        self.epoch = 0
        #: global batches of `epoch` already handed out; iteration continues from there
        self.position = 0

    def set_epoch(self, epoch: int) -> None:
        """Use epoch's order on the next iteration (call at the start of every epoch). The same
        epoch again keeps the position (a run resumed in the middle of an epoch goes on from
        there); another epoch starts at its first batch."""
        if int(epoch) != self.epoch:
            self.position = 0
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """Steps per epoch."""
        full, rest = divmod(self.dataset_size, self.global_batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The epoch's sample order (identical on every rank and for every number of ranks)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return np.arange(self.dataset_size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)

    def global_batches(self, epoch: int | None = None) -> Iterator[np.ndarray]:
        """The sample indices of each global batch of the epoch."""
        order = self.order(epoch)
        B = self.global_batch_size
        for step in range(len(self)):
            batch = order[step * B:(step + 1) * B]
            if len(batch) < B and self.pad:
                wrap = np.resize(order, B - len(batch))
                batch = np.concatenate([batch, wrap])
            yield batch

    def local_slice(self, batch: np.ndarray) -> np.ndarray:
        """This rank's contiguous slice of a global batch (whole atoms with `atoms`)."""
        if self.atoms:
            cuts = split_bounds(len(batch), self.atoms)
            mine = split_bounds(self.atoms, self.num_replicas)
            return batch[cuts[mine[self.rank]]:cuts[mine[self.rank + 1]]]
        bounds = split_bounds(len(batch), self.num_replicas)
        return batch[bounds[self.rank]:bounds[self.rank + 1]]

    def local_atoms(self, batch_size: int) -> list[int]:
        """The sizes of the atoms of this rank's slice of a global batch of batch_size."""
        cuts = split_bounds(batch_size, self.atoms)
        mine = split_bounds(self.atoms, self.num_replicas)
        return [int(cuts[a + 1] - cuts[a]) for a in range(mine[self.rank], mine[self.rank + 1])]

    def __iter__(self) -> Iterator[tuple[np.ndarray, int]]:
        """This rank's slice of each global batch from `position` on (then from the start)."""
        start = self.position if self.position < len(self) else 0
        for step, batch in enumerate(self.global_batches()):
            if step >= start:
                self.position = step + 1
                self.batch = batch
                yield self.local_slice(batch), len(batch)

    def state_dict(self) -> dict[str, Any]:
        """What determines the order (not the rank or number of ranks: a run may resume with
        another number of ranks)."""
        return {"dataset_size": self.dataset_size, "global_batch_size": self.global_batch_size,
                "shuffle": self.shuffle, "seed": self.seed, "drop_last": self.drop_last,
                "pad": self.pad, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`; the dataset size and global batch must match."""
        for key in ("dataset_size", "global_batch_size"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(f"load_state_dict: {key} is {state[key]} in the saved state but "
                                 f"{getattr(self, key)} here")
        self.shuffle, self.seed = bool(state["shuffle"]), int(state["seed"])
        self.drop_last, self.pad = bool(state["drop_last"]), bool(state["pad"])
        self.epoch = int(state["epoch"])
        self.position = int(state.get("position", 0))


class RandomBatchSampler(DistributedSampler):
    """Global batches drawn at random, with replacement, as nanoGPT's get_batch draws random
    offsets into a token stream: step s of the run (epoch × steps_per_epoch + position) takes
    `global_batch_size` indices in [0, dataset_size) from a generator seeded with (seed, s), the
    same for every number of ranks; each rank takes its slice as under `DistributedSampler`.
    An epoch is `steps_per_epoch` steps.
    """

    def __init__(self, dataset_size: int, global_batch_size: int, steps_per_epoch: int,
                 rank: int = 0, num_replicas: int = 1, seed: int = 0, atoms: int = 0) -> None:
        super().__init__(dataset_size, global_batch_size, rank=rank, num_replicas=num_replicas,
                         seed=seed, atoms=atoms)
        if not isinstance(steps_per_epoch, int | np.integer) or steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch: expected an integer >= 1, got "
                             f"{steps_per_epoch!r}")
        self.steps_per_epoch = int(steps_per_epoch)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def global_batches(self, epoch: int | None = None) -> Iterator[np.ndarray]:
        epoch = self.epoch if epoch is None else epoch
        for position in range(len(self)):
            yield random_batch(self.seed, epoch * len(self) + position, self.dataset_size,
                               self.global_batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "steps_per_epoch": self.steps_per_epoch}


def random_batch(seed: int, step: int, dataset_size: int, batch_size: int) -> np.ndarray:
    """The indices of the global batch of `step` under RandomBatchSampler."""
    return np.random.default_rng([seed, 1, step]).integers(0, dataset_size, batch_size)
