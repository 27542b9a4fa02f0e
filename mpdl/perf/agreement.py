"""The models of a training step that `benchmarks/simulate_agreement.py` checks against measured
steps (ZeRO's and the pipeline's, built from the calibrated cost model), and its verdict on the
ratios of predicted to measured.
"""

from __future__ import annotations

import statistics

from mpdl.perf import oversubscription as O
from mpdl.perf import simulate as S
from mpdl.tuning import costmodel as cm

#: how far from 1 a median ratio of predicted to measured time may lie
TOLERANCE = 0.25
#: ... and of predicted to measured memory
MEMORY_TOLERANCE = 0.10


def verdict(ratios: list[float], tolerance: float = TOLERANCE) -> tuple[float, bool]:
    """(median ratio, whether it lies within ±tolerance of 1)."""
    ratio = statistics.median(ratios)
    return ratio, abs(ratio - 1) <= tolerance


def zero_step(compute_s: float, pure_s: float, own_s: float, unit_bytes: list[int], stage: int,
              p: int, params: cm.Params, cores: int) -> float:
    """The ZeRO model's step: the compute (timed with every rank at once), ZeRO's own work `own_s`
    (timed on one rank, see the benchmark's `own_work_times`; time-sliced like the compute when
    ranks outnumber the cores) and, per unit, the calibrated ring reduce-scatter and all-gather
    (two all-gathers at stage 3: before forward and again before backward), all exposed, each
    handed to the communication thread and waited for (`params.handoff` a call). LeNet's stages 1
    and 2 have a single unit, whose reduce-scatter starts when backward ends and whose all-gather
    follows the optimizer; stage 3's prefetched gathers and early reduce-scatters are taken as
    exposed too.

    With more ranks than `cores`, the step takes no less than what every rank asks of the shared
    cores (`oversubscription.span`): its compute `pure_s` (timed with no more ranks than cores at
    once), its collectives' share of the cores (a calibrated time at p ranks on `cores` cores held
    cores/p of a core), its own work and its handoffs, and one wait for each ring step and each
    handoff."""
    gathers = 2 if stage == 3 else 1
    calls = len(unit_bytes) * (1 + gathers)
    comm = sum(cm.predict("reduce_scatter", "ring", b, p, 1, params)
               + gathers * cm.predict("allgather", "ring", b, p, 1, params) for b in unit_bytes)
    handoffs = calls * params.handoff
    step = compute_s + own_s * max(1.0, p / cores) + comm + handoffs
    if p > cores:
        work = pure_s + own_s + comm * cores / p + handoffs
        waits = calls * (p - 1) + calls
        step = max(step, O.span([work] * p, [waits] * p, cores, params.wait_cpu,
                                params.wait_share))
    return step


def pipeline_step(stages: dict, m: int, dp: int, params: cm.Params, cores: int) -> dict:
    """The pipeline model's step: one microbatch through every stage (forward and backward) and
    m-1 more paced by the slowest stage, the activation and gradient messages of each boundary on
    that path, the slowest stage's optimizer step, and with dp > 1 the ring all-reduce of the
    largest stage's gradient over dp ranks (after the flush: exposed). With more ranks than
    `cores`, the flush takes no less than every rank's compute and what its waits for the
    messages of its neighbour stages take, spread over the cores (`oversubscription.span`)."""
    slot = [f + b for f, b in zip(stages["forward"], stages["backward"], strict=True)]
    pp = len(slot)
    # more ranks than cores: every rank's m slots, and its waits (stage s receives m activations
    # when s > 0 and m gradients when s < pp - 1), share the cores, however short the path
    flush = O.span([m * t for t in slot] * dp, [m * ((s > 0) + (s < pp - 1)) for s in range(pp)] * dp,
                   cores, params.wait_cpu, params.wait_share)
    compute = max(S.pipeline_compute(slot, m), flush)
    p2p = sum(2 * params.exchange_time(n) for n in stages["output_bytes"][:-1])
    optimizer = max(stages["optimizer"])
    dp_comm = (cm.predict("allreduce", "ring", max(stages["grad_bytes"]), dp, 1, params)
               if dp > 1 else 0.0)
    # the last stage's loss and accuracy go to every stage (a broadcast of three numbers)
    share = cm.predict("broadcast", "tree", 24, len(slot), 1, params)
    total = compute + p2p + optimizer + dp_comm + share
    return {"step_s": total, "compute_s": compute, "bubble_s": compute - m * max(slot),
            "p2p_s": p2p, "optimizer_s": optimizer, "dp_comm_s": dp_comm}


# -- the transformer's axes: recomputation, experts, context ----------------------------------------
def _allreduce(nbytes: float, p: int, params: cm.Params) -> float:
    """A ring all-reduce handed to the communication thread, 0 on one rank."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    return cm.predict("allreduce", "ring", int(nbytes), p, 1, params) + params.handoff


def _sync(pieces: dict, p: int, cores: int) -> float:
    """What one point where p ranks wait for each other after computing costs beyond its message:
    `sync_s` (the wait for the slowest rank, measured after one block's forward) with no more
    ranks than cores, where a waiting rank's core has no other rank of the job to run; none on one
    rank, and none with more ranks than cores, where a rank that waits leaves its core to one that
    computes, whose share of the cores the pieces (timed with every rank at once) already hold."""
    return pieces["sync_s"] if 1 < p <= cores else 0.0


def recompute_step(pieces: dict, mode: str, p: int, grad_bytes: int, params: cm.Params,
                   cores: int) -> float:
    """The recomputation model's step (`mpdl.perf.layouts`' term): forward, backward and the
    optimizer as timed without recomputation (every rank at once), plus in backward the blocks'
    forward again (full) or each attention core's forward again (selective), and the gradient's
    ring all-reduce over p ranks once backward has ended (one bucket: nothing left to overlap),
    with the wait for the slowest rank before it (`_sync`)."""
    extra = {"none": 0.0, "selective": pieces["core_forward_s"],
             "full": pieces["blocks_forward_s"]}[mode]
    return (pieces["forward_s"] + pieces["backward_s"] + extra + pieces["optimizer_s"]
            + _allreduce(grad_bytes, p, params) + _sync(pieces, p, cores))


def expert_step(pieces: dict, p: int, ep: int, moe_layers: int, rows_bytes: int,
                dense_bytes: int, expert_bytes: int, experts: int, params: cm.Params,
                cores: int) -> float:
    """The expert-parallel model's step (`layouts.expert_time`): the compute timed with all the
    experts on one rank (every rank at once: the same routed rows meet the same FLOPs wherever
    the experts live), its optimizer step scaled to the parameters a rank holds, and per MoE
    layer two pairwise all-to-alls of the rank's routed rows (`rows_bytes`: dispatch and combine)
    in forward and two in backward, with the routing counts (an all-reduce over the p
    data-parallel ranks and an all-to-all over ep) before them; then, not overlapped, the ring
    all-reduce of the dense gradients over p ranks and of the experts' over the p/ep replicas.
    Each point where a rank waits for the others after computing costs `sync_s` besides its
    message (`_sync`): per MoE layer the counts' all-reduce, and with ep > 1 the
    combine in forward and both all-to-alls in backward (the counts' all-to-all and the dispatch
    follow the counts' all-reduce with little compute between); and once before the gradients'
    all-reduces."""
    held = (dense_bytes + expert_bytes / ep) / (dense_bytes + expert_bytes)
    per_layer = 0.0
    if ep > 1:
        per_layer += 4 * cm.predict("alltoall", "pairwise", rows_bytes, ep, 1, params)
        per_layer += cm.predict("alltoall", "pairwise", 8 * experts, ep, 1, params)
        per_layer += 3 * _sync(pieces, p, cores)
    if p > 1:
        per_layer += (cm.predict("allreduce", "ring", 8 * experts, p, 1, params)
                      + _sync(pieces, p, cores))
    return (pieces["forward_s"] + pieces["backward_s"] + held * pieces["optimizer_s"]
            + moe_layers * per_layer + _allreduce(dense_bytes, p, params)
            + _allreduce(expert_bytes, p // ep, params) + _sync(pieces, p, cores))


def context_step(pieces: dict, cp: int, mode: str, layers: int, kv_bytes: int, grad_bytes: int,
                 params: cm.Params, cores: int) -> dict:
    """The context-parallel model's step (`step_s`) and its terms (`layouts.context_parallel_time`
    on this machine), from pieces timed on one rank without a message (every rank at once): forward,
    backward and the optimizer of the model as the cp run builds it at the T/cp positions a rank
    holds with its attention local, that local attention (`local_attention_s`) replaced by the
    attention compute of the mode (`blocked_attention_s`: a rank's chunks against every rank's
    K/V chunks, as ring and allgather attend; `ulysses_attention_s`: the whole sequence for
    H/cp heads), all blocks; per layer the messages of the mode, `kv_bytes` being K and V of the
    whole sequence:

    * ring: cp − 1 shifts of a rank's K/V block in forward, cp − 1 in backward and cp shifts of
      the dK/dV sums, each handed to the communication thread (`params.handoff`) and each hidden
      where it lasts less than one chunk step of attention (the last sums' wait follows the last
      step: exposed); with cp ≥ `cores` none is hidden: every core already runs a rank's
      attention, and the communication thread, which needs a core and the GIL, progresses only
      once the rank waits;
    * ulysses: all-to-alls of Q, K and V (packed) and of the output in forward, of the output's
      gradient and of dQ, dK, dV in backward;
    * allgather: an all-gather of K and V in forward, and in backward another (the gathered K
      and V are not kept) and a reduce-scatter of their gradients;

    then the gradients' ring all-reduce over the cp ranks (they hold the same parameters) and the
    loss's over them. Every point where a rank waits for the others after computing (per layer
    ring 2cp − 1, ulysses 4, allgather 3; the two all-reduces) costs `_sync` besides its message:
    the wait for the slowest rank on shared cores, as measured after one block's forward.

    Terms: `compute_s` (the pieces with the local attention), `attention_s` (the mode's
    attention compute less the local one), `messages_s`, `reductions_s` (the two all-reduces'
    messages) and `waits_s` (the synchronisations)."""
    block = kv_bytes / cp
    local = pieces["forward_s"] + pieces["backward_s"] + pieces["optimizer_s"]
    attention = pieces["ulysses_attention_s" if mode == "ulysses" else "blocked_attention_s"]
    if mode == "ring":
        shift = params.exchange_time(block, ring=True) + params.handoff
        chunk_step = 0.0 if cp >= cores else pieces["blocked_attention_s"] / (layers * 2 * cp)
        per_layer = ((cp - 1) * (max(0.0, shift - chunk_step) + max(0.0, 2 * shift - chunk_step))
                     + shift)
        waits = 2 * cp - 1
    elif mode == "ulysses":
        qkv, out = 1.5 * kv_bytes / cp, 0.5 * kv_bytes / cp
        per_layer = 2 * (cm.predict("alltoall", "pairwise", int(qkv), cp, 1, params)
                         + cm.predict("alltoall", "pairwise", int(out), cp, 1, params))
        waits = 4
    else:
        per_layer = (2 * cm.predict("allgather", "ring", int(kv_bytes), cp, 1, params)
                     + cm.predict("reduce_scatter", "ring", int(kv_bytes), cp, 1, params))
        waits = 3
    reductions = (cm.predict("allreduce", "ring", int(grad_bytes), cp, 1, params)
                  + cm.predict("allreduce", "ring", 16, cp, 1, params))
    terms = {"compute_s": local, "attention_s": attention - pieces["local_attention_s"],
             "messages_s": layers * per_layer, "reductions_s": reductions,
             "waits_s": (layers * waits + 2) * _sync(pieces, cp, cores)}
    return {"step_s": sum(terms.values()), **terms}
