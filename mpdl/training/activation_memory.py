"""The bytes of activations a transformer layer of mpdl's GPT keeps for backward, derived op by op
(docs/memory.md has the table), beside Korthikanti et al. 2022's sbh(34 + 5as/h).

s sequence length, b microbatch (per rank), h width, a heads, t tensor-parallel ranks, `itemsize`
bytes per element. mpdl keeps, per layer, every array a graph node saved or took as input, each
buffer once (`mpdl.memory`):

- no recomputation: (18 + 4·[dropout]) sbh elements, 4sb LayerNorm statistics and the attention
  probabilities a·s²·b; with t > 1, (10 + 4·[dropout] + 13/t) sbh + 4sb + a·s²·b/t elements,
  plus a 4 KiB page for each of the two all-reduce results (NumPy places an array of a page or
  more at its input's offset within a page, `backend.empty_like_page_offset`);
- selective (the attention core recomputed): the same without the probabilities;
- full (each block recomputed): the block's input, sbh, plus, while one block's backward runs,
  that block's whole set again (`recompute_peak_extra`).
"""

from __future__ import annotations

from mpdl.backend import PAGE

RECOMPUTE = ("none", "selective", "full")


def layer_activation_bytes(s: int, b: int, h: int, a: int, itemsize: int = 4, t: int = 1,
                           recompute: str = "none", dropout: bool = False,
                           numpy: bool = True) -> int:
    """Bytes one transformer layer keeps for backward in mpdl (see the module docstring);
    `numpy`: the arrays are NumPy's (CuPy's all-reduce results need no page)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute: expected one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if recompute == "full":
        return s * b * h * itemsize
    sbh, sb = s * b * h, s * b
    masks = 4 * sbh if dropout else 0   # two masks and two outputs of the residual dropouts
    if t == 1:
        elements = 18 * sbh + masks + 4 * sb
    else:
        elements = 10 * sbh + masks + 13 * sbh // t + 4 * sb
    if recompute == "none":
        elements += a * s * s * b // t
    pages = 2 * PAGE if t > 1 and numpy and sbh * itemsize >= PAGE else 0
    return elements * itemsize + pages


def recompute_peak_extra(s: int, b: int, h: int, a: int, itemsize: int = 4, t: int = 1,
                         dropout: bool = False) -> int:
    """Full recomputation: the bytes one block's recomputed forward holds during its backward."""
    return layer_activation_bytes(s, b, h, a, itemsize, t, "none", dropout)


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1,
                            recompute: str = "none") -> float:
    """Korthikanti et al. 2022 (16-bit activations, 1-byte dropout masks): sbh(34 + 5as/h) per
    layer; with tensor parallelism and sequence parallelism sbh(34 + 5as/h)/t; selective
    recomputation 34·sbh/t; full recomputation 2sbh (the layer's input)."""
    if recompute == "full":
        return 2.0 * s * b * h
    if recompute == "selective":
        return 34.0 * s * b * h / t
    return s * b * h * (34.0 + 5.0 * a * s / h) / t


def model_activation_bytes(s: int, b: int, h: int, a: int, vocab: int, layers: int,
                           itemsize: int = 4, t: int = 1, recompute: str = "none",
                           dropout: bool = False, embedding: bool = True, head: bool = True,
                           numpy: bool = True) -> int:
    """The most activation bytes a GPT step keeps at one time on a rank that runs `layers`
    blocks, with the embedding and the head (or a pipeline stage's share of them).

    Beside the layers: the embedding's token ids and position indices (int64), its token rows and
    position rows (and with dropout its mask and output); the head's input, the final
    LayerNorm's output and row statistics, the logits and their log-sum-exp per row, the loss's
    labels (int64). With full
    recomputation the peak is the larger of the end of forward (every block's input, the
    embedding and the head) and the recomputation of the last block in backward (its whole set,
    while the head is already released). A pipeline stage without the embedding takes its input
    in its receive buffer, which the ledger counts as communication, not here."""
    sbh, sb = s * b * h, s * b
    embed = (8 * sb + 8 * s + itemsize * (sbh + s * h) + (2 * itemsize * sbh if dropout else 0)
             if embedding else 0)
    top = itemsize * (2 * sbh + 3 * sb + sb * vocab) + 8 * sb if head else 0
    kept = layers * layer_activation_bytes(s, b, h, a, itemsize, t, recompute, dropout, numpy)
    if not embedding and layers:
        kept -= itemsize * sbh
    if recompute != "full" or not layers:
        return kept + embed + top
    whole = layer_activation_bytes(s, b, h, a, itemsize, t, "none", dropout, numpy)
    return max(kept + embed + top, kept - itemsize * sbh + whole + embed)
