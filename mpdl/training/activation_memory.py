"""The bytes of activations a transformer layer of mpdl's GPT keeps for backward, derived op by op
(docs/memory.md has the table), beside Korthikanti et al. 2022's sbh(34 + 5as/h).

s sequence length, b microbatch (per rank), h width, a heads, t tensor-parallel ranks (sequence
parallel or not), c context-parallel ranks, `itemsize` bytes per element. mpdl keeps, per layer,
every array a graph node saved or took as input, each buffer once (`mpdl.memory`):

- no recomputation, one rank: (25 + 4·[dropout]) sbh elements, 2sb LayerNorm statistics and the
  attention probabilities a·s²·b;
- the tensor-parallel blocks (t > 1 or c > 1), per layer, with g = t under sequence parallelism
  (else 1) the share of the sequence the LayerNorms and dropouts see, over c:
  the LayerNorms' inputs, x̂ and outputs 6sbh/g + 2sb/g; the row-parallel partial outputs 2sbh;
  their reduced sums 2sbh/g (t > 1); the sums plus bias 2sbh/g; the gathered inputs of the
  column-parallel layers 2sbh (sequence parallel); this rank's heads and hidden units 17sbh/t
  (q, k, v 3, attention output and its contiguous copy 2, fc output, GELU's Φ(x) and output
  4 each; 16 with c > 1: the ring attention lays its output out so that the copy is a view);
  the residual dropouts' masks and outputs 4sbh/g; and the attention probabilities a·s²·b/t, or
  with c > 1 the ring attention's log-sum-exp a·s·b/t; all of it divided by c (each rank holds
  s/c positions of every sequence). Without sequence parallelism, in float32 on NumPy, a 4 KiB
  page more for each of the two all-reduce results (NumPy places an array of a page or more at
  its input's offset within a page, `backend.empty_like_page_offset`; 16-bit messages come back
  as fresh float32 copies);
- selective (the attention core recomputed): the same without the probabilities;
- full (each block recomputed): the block's input, sbh/(g·c), plus, while one block's backward
  runs, that block's whole set again (`recompute_peak_extra`).
"""

from __future__ import annotations

from mpdl.backend import PAGE

RECOMPUTE = ("none", "selective", "full")


def layer_activation_bytes(s: int, b: int, h: int, a: int, itemsize: int = 4, t: int = 1,
                           recompute: str = "none", dropout: bool = False, numpy: bool = True,
                           sp: bool = False, c: int = 1, precision: str = "fp32") -> int:
    """Bytes one transformer layer keeps for backward in mpdl (see the module docstring);
    `numpy`: the arrays are NumPy's (CuPy's all-reduce results need no page); `sp`: sequence
    parallelism over the t ranks; `precision`: bf16 and fp16 send the tensor-parallel messages in
    16 bits (the activations stay float32 on NumPy: `itemsize` 4)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute: expected one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    g = t if sp and t > 1 else 1
    if recompute == "full":
        return s * b * h * itemsize // (g * c)
    sbh, sb = s * b * h, s * b
    if t == 1 and c == 1:  # the GPT's own blocks
        elements = 25 * sbh + (4 * sbh if dropout else 0) + 2 * sb
        if recompute == "none":
            elements += a * s * s * b
        return elements * itemsize
    per_sequence = ((6 + (2 if t > 1 else 0) + 2 + (4 if dropout else 0)) * sbh + 2 * sb) // g \
        + (2 + (2 if g > 1 else 0)) * sbh + (17 if c == 1 else 16) * sbh // t
    if recompute == "none":
        per_sequence += (a * s * s * b if c == 1 else a * s * b) // t
    pages = 2 * PAGE if (t > 1 and g == 1 and numpy and precision == "fp32"
                         and sbh * itemsize // c >= PAGE) else 0
    return per_sequence // c * itemsize + pages


def recompute_peak_extra(s: int, b: int, h: int, a: int, itemsize: int = 4, t: int = 1,
                         dropout: bool = False, sp: bool = False, c: int = 1,
                         precision: str = "fp32") -> int:
    """Full recomputation: the bytes one block's recomputed forward holds during its backward."""
    return layer_activation_bytes(s, b, h, a, itemsize, t, "none", dropout, sp=sp, c=c,
                                  precision=precision)


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1,
                            recompute: str = "none", c: int = 1) -> float:
    """Korthikanti et al. 2022 (16-bit activations, 1-byte dropout masks): sbh(34 + 5as/h) per
    layer; with tensor parallelism and sequence parallelism sbh(34/t + 5as/(ht)); selective
    recomputation 34·sbh/t; full recomputation 2sbh (the layer's input). Context parallelism
    (not in the paper; Megatron-LM's) holds s/c positions: every term over c."""
    if recompute == "full":
        return 2.0 * s * b * h / c
    if recompute == "selective":
        return 34.0 * s * b * h / t / c
    return s * b * h * (34.0 + 5.0 * a * s / h) / t / c


def model_activation_bytes(s: int, b: int, h: int, a: int, vocab: int, layers: int,
                           itemsize: int = 4, t: int = 1, recompute: str = "none",
                           dropout: bool = False, embedding: bool = True, head: bool = True,
                           numpy: bool = True, precision: str = "fp32") -> int:
    """The most activation bytes a GPT step keeps at one time on a rank that runs `layers`
    blocks, with the embedding and the head (or a pipeline stage's share of them).

    Beside the layers: the embedding's token ids and position indices (int64), its token rows and
    position rows (and with dropout its mask and output); the head's input, final LayerNorm,
    logits and their log-softmax, the loss's labels and row index (int64). With full
    recomputation the peak is the larger of the end of forward (every block's input, the
    embedding and the head) and the recomputation of the last block in backward (its whole set,
    while the head is already released). A pipeline stage without the embedding takes its input
    in its receive buffer, which the ledger counts as communication, not here; in bf16 and fp16
    that buffer is 16-bit and the stage keeps the float32 copy it computes from."""
    sbh, sb = s * b * h, s * b
    embed = (8 * sb + 8 * s + itemsize * (sbh + s * h) + (2 * itemsize * sbh if dropout else 0)
             if embedding else 0)
    top = itemsize * (3 * sbh + sb + 2 * sb * vocab) + 16 * sb if head else 0
    kept = layers * layer_activation_bytes(s, b, h, a, itemsize, t, recompute, dropout, numpy,
                                           precision=precision)
    if not embedding and layers and precision == "fp32":
        kept -= itemsize * sbh
    if recompute != "full" or not layers:
        return kept + embed + top
    whole = layer_activation_bytes(s, b, h, a, itemsize, t, "none", dropout, numpy,
                                   precision=precision)
    return max(kept + embed + top, kept - itemsize * sbh + whole + embed)
