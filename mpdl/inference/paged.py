"""A paged KV cache: keys and values in fixed-size pages, a block table per sequence, prompts that
begin alike sharing their pages (PagedAttention, as vLLM keeps its cache).

    pool.k[layer, head, slot]     slot = page · page_size + offset: position p of a sequence
                                  whose block table is `table` sits at slot
                                  table[p // page_size] · page_size + p % page_size

A `PagePool` holds `pages` pages of one decoder's blocks and heads (under tensor parallelism a
rank's heads, on a pipeline stage its blocks), a free list and a reference count per page. A
sequence takes pages as it grows, one at a time, instead of a whole block up front. **Prefix
sharing:** a page whose tokens are all prompt tokens is registered under the whole prompt prefix
it ends (`prefix_key`); a later prompt that begins with that prefix takes the page with one more
reference instead of computing it again. A page goes back to the free list when its last
reference is dropped.

`forward` runs a batch of rows, each a run of new tokens of one sequence at positions start ..
start + n − 1 (a prompt, a chunk of it after shared pages, or one decode token): it writes their
keys and values into the sequence's pages and attends to positions 0 .. start + n − 1 gathered
from them. NumPy has no kernel that reads pages in place, so each layer gathers the whole pages of
every row into a (heads, rows, positions, head_dim) array, a copy of page-sized runs of memory:
that copy is what paging costs here (benchmarks/bench_serve.py measures it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpdl.backend import get_array_module
from mpdl.inference.inference import Decoder, _softmax_


class OutOfPages(Exception):
    """The pool has no free page."""


def prefix_key(tokens: Sequence[int], end: int) -> tuple[int, ...]:
    """The key a page ending at position `end` of a prompt is shared under: the prompt's first
    `end` tokens."""
    return tuple(tokens[:end])


class PagePool:
    """`pages` pages of `page_size` positions for `layers` blocks of `heads` heads: keys and values
    (layers, heads, pages · page_size, head_dim), a free list, reference counts and the pages of
    shared prompt prefixes."""

    def __init__(self, layers: int, heads: int, head_dim: int, pages: int, page_size: int,
                 dtype: Any, xp: Any = np) -> None:
        if pages < 1 or page_size < 1:
            raise ValueError(f"pages and page_size: expected positive numbers, got {pages}, "
                             f"{page_size}")
        self.page_size, self.pages = page_size, pages
        shape = (layers, heads, pages * page_size, head_dim)
        self.k = xp.zeros(shape, dtype=dtype)
        self.v = xp.zeros(shape, dtype=dtype)
        self.free = list(range(pages - 1, -1, -1))
        self.refs = [0] * pages
        self.shared: dict[tuple[int, ...], int] = {}
        self._key_of: dict[int, tuple[int, ...]] = {}

    @property
    def in_use(self) -> int:
        return self.pages - len(self.free)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (keys and values of every layer and head)."""
        return int(self.k.nbytes + self.v.nbytes) // self.pages

    def take(self) -> int:
        """A free page with one reference; OutOfPages when there is none."""
        if not self.free:
            raise OutOfPages
        page = self.free.pop()
        self.refs[page] = 1
        return page

    def share(self, key: tuple[int, ...]) -> int | None:
        """The page registered under a prompt prefix, with one more reference, or None."""
        page = self.shared.get(key)
        if page is not None:
            self.refs[page] += 1
        return page

    def register(self, key: tuple[int, ...], page: int) -> None:
        """Offer a computed page of prompt tokens to later prompts that begin with `key`."""
        if key not in self.shared and page not in self._key_of:
            self.shared[key] = page
            self._key_of[page] = key

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; a page without references is free again."""
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                key = self._key_of.pop(page, None)
                if key is not None:
                    del self.shared[key]
                self.free.append(page)

    def slots(self, table: Sequence[int], start: int, stop: int) -> np.ndarray:
        """The slots of positions start .. stop − 1 of a sequence with block table `table`."""
        pos = np.arange(start, stop)
        return np.asarray(table, dtype=np.int64)[pos // self.page_size] * self.page_size \
            + pos % self.page_size


def forward(decoder: Decoder, pool: PagePool, rows: list[tuple[Sequence[int], int, Sequence[int]]],
            x: Any = None) -> Any:
    """Run rows (block table, start, new tokens) through the decoder's blocks, writing the new
    keys and values into the pool: from the tokens' embeddings, or (on a later pipeline stage)
    from the hidden states x (rows, longest run, C) of the stage before; returns the hidden
    states of every position (rows, longest run, C)."""
    xp = decoder.xp
    size = pool.page_size
    n = np.array([len(r[2]) for r in rows])
    start = np.array([r[1] for r in rows])
    t, ctx = int(n.max()), start + n
    width = -(-int(ctx.max()) // size) * size
    ids = np.zeros((len(rows), t), dtype=np.int64)
    pos = np.zeros((len(rows), t), dtype=np.int64)
    tables = np.zeros((len(rows), width // size), dtype=np.int64)
    write = []
    for b, (table, s, tokens) in enumerate(rows):
        ids[b, :len(tokens)] = tokens
        pos[b] = np.minimum(s + np.arange(t), decoder.block_size - 1)
        used = -(-int(ctx[b]) // size)
        tables[b, :used] = table[:used]
        write.append(pool.slots(table, s, s + len(tokens)))
    valid = np.arange(t)[None, :] < n[:, None]
    # query t of row b sees the keys at positions up to start_b + t, and none past the row's end
    keys = np.arange(width)[None, None, :]
    allowed = (keys <= (start[:, None] + np.arange(t))[:, :, None]) & (keys < ctx[:, None, None])
    mask = xp.asarray(np.where(allowed, 0, -np.inf).astype(decoder.dtype))[None]
    write, valid_x, tables = xp.asarray(np.concatenate(write)), xp.asarray(valid), xp.asarray(tables)
    heads, head_dim = pool.k.shape[1], pool.k.shape[3]

    def pages(a: Any) -> Any:
        """Whole pages of every row, (heads, rows, width, head_dim): a copy of page-sized runs."""
        return a.reshape(heads, pool.pages, size, head_dim)[:, tables].reshape(
            heads, len(rows), width, head_dim)

    def attend(layer: int, q: Any, k: Any, v: Any) -> Any:
        pool.k[layer][:, write] = k.transpose(1, 0, 2, 3)[:, valid_x]
        pool.v[layer][:, write] = v.transpose(1, 0, 2, 3)[:, valid_x]
        att = q.transpose(1, 0, 2, 3) @ xp.swapaxes(pages(pool.k[layer]), -1, -2)
        att *= decoder.scale
        att += mask
        return (_softmax_(att) @ pages(pool.v[layer])).transpose(1, 0, 2, 3)

    if x is None:
        x = decoder.wte[xp.asarray(ids)] + decoder.wpe[xp.asarray(pos)]
    return decoder._blocks(x, attend)


def last_positions(x: Any, rows: list[tuple[Sequence[int], int, Sequence[int]]]) -> Any:
    """The hidden state of each row's last new token (rows, C) from forward's (rows, T, C)."""
    xp = get_array_module(x)
    return x[xp.arange(len(rows)), xp.asarray([len(r[2]) - 1 for r in rows])]
