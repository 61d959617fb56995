"""Cost model: predicted step time of a layout (seconds), as a sum of a compute term and exposed-communication terms.

Notation: h hidden, a heads, kv = kv heads x h/a, L layers, V vocab, s seq length, B bytes per element of the
compute dtype, t tp, c cp (u its Ulysses part, r = c/u its ring part), p pp, v virtual chunks, d dp, e ep, b rows
per micro-batch (batch_size x micro_batch_interleave_num), m micro-batches per step (micro_batch_num when p > 1,
gradient accumulation steps otherwise), Ls the busiest stage's layers, F = flops x mfu (per device), BW(g) the link
of group g: intra (devices_per_node) when the group's ranks fit in one node, inter otherwise; alpha = latency per
collective. Rank order is DESIGN.md's: pp outermost, then dp, cp ring, cp Ulysses, tp innermost, so a group spans
(its size x the sizes inside it) consecutive ranks: tp t, Ulysses u*t, ring c*t, dp x cp d*c*t, ep e (blocks of e
consecutive ranks folded out of dp x cp x tp), and pipeline neighbours are d*c*t ranks apart.

- compute  = m x max over pipeline ranks j of {Lj x [(6 P_layer b s + 12 h b s^2) / (t c) x (1 + rc/3) / F
                 + mbi x (1 + rc/2) x links.layer_call_s] + [j last] 6 V h b s / (t c) / F} (the output head on
                 the last stage); ranks that share cores (links.shared_cores) pace at the mean over j instead
             P_layer = matmul parameters a token passes (dense: attention + 3 h ffn; MoE: attention + shared +
             top_k experts, averaged over dense and MoE layers); 6 = forward 2 + backward 4 FLOPs per parameter and
             token; 12 h s^2 per row and layer = attention scores and values forward + backward (Megatron's count);
             rc = recomputed share of the stage's layers (a recomputed layer runs its forward, 1/3, twice);
             layer_call_s = the fixed cost of one layer's forward + backward call (launches, Python, autograd),
             which is why small micro-batches and many copies run below the FLOP rate (calibrate measures it).
- tp       = m Ls [8 (t-1)/t X / BW(t) + 8 alpha] x (1 + rc/2) x (1 - 0.7 (mbi-1)/mbi), X = b (s/c) h B:
             2 all-reduces forward and 2 backward per layer (each 2 (t-1)/t X); sequence parallel replaces each by an
             all-gather + reduce-scatter, the same bytes (it saves activation memory, not time); recompute repeats
             the forward half; micro_batch_interleave_num hides 70% of the (mbi-1)/mbi share that another copy's
             compute can cover (measured 67-72%, NOTES.md) and pays mbi x the latencies. Not overlapped otherwise.
- cp       ring: per layer 3 (r-1) steps of K/V blocks, Y = 2 b (s/c) kv B / min(t, kv heads) each (K, V forward;
             K, V and dK, dV backward), overlapped with the layer's attention compute: exposed = max(0, ring - attn);
             Ulysses: 8 all-to-alls per layer (q, k, v, out; forward and backward), 2 (u-1)/u b (s/c) (h + kv) B / t
             bytes per direction, not overlapped. Hybrid = both. Times m Ls (1 + rc/2).
- ep       = m Lmoe [4 (e-1)/e n k h B / BW(e) + 4 alpha], n = b s / c tokens (/t with sequence parallel): dispatch
             and combine all-to-all forward and backward; Lmoe = MoE layers of the busiest stage.
- dp       G = 2 (n-1)/n x params_per_rank x B / BW(d*c) (a ring all-reduce over dp x cp; routed experts over the
             expert-data-parallel group). ZeRO 0: overlapped with the last micro-batch's backward except the last
             bucket: max(G - bwd, G / gradient_aggregation_group). ZeRO 1/2: the reduce-scatter half overlaps the same
             way, the all-gather of updated weights after the step (G/2) does not. ZeRO 3: weights re-gathered in
             forward and backward of every micro-batch (m G) plus the reduce-scatter, overlapped with all compute:
             max(0, m G + G/2 - compute) + the first layer's gather G / (2 Ls).
- pp       = m x 2 v x (Z / BW(pp) + alpha), Z = b (s/c) h B (/t with sequence parallel): activations forward and
             gradients backward at every chunk boundary; assumed not overlapped.
- bubble   = f x (compute + tp + cp + ep) with f = (p-1)/m for 1f1b and gpipe (so bubble / (compute + bubble) =
             (p-1)/(m+p-1) without communication), (p-1)/(v m) interleaved, and zero_bubble_v (p-1)/(v m) x
             max(0, 1 - m/(2p)): none once m >= 2p. When the ranks share K < world cores (links.shared_cores, a
             CPU run), a waiting rank's core goes to the others: the step is the longer of the busiest rank's path
             at a whole core (K/world x busy x (1 + f)) and the total work (busy): bubble = max(0, that - busy).
- latency  every collective call pays alpha = links.latency, once per multi-copy (mbi) copy: tp 8 per layer,
             ring 3 (r-1) (the engines check cp peers' inputs once per step, not per call), Ulysses 8, ep 4,
             pp 2 v per micro-batch, ZeRO-3 3 per parameter tensor (DeepSpeed gathers and reduce-scatters each
             tensor on its own; ~9 tensors a layer) and micro-batch. On a shared
             machine calibrate measures alpha between matmuls on every rank (what a training step sees), not idle.
- shared cores (links.shared_cores > 0, a CPU run): collectives run on the cores the compute uses, so the
             overlaps above (dp with the backward, ring with attention, ZeRO-3 gathers with compute) do not happen.
- optim    = local parameters x links.adam_s_per_param: the AdamW update of this rank's share (ZeRO >= 1 updates
             1/(dp x cp) of the dense parameters, 1/expert-dp of the routed experts); calibrate measures it.
Step time = compute + tp + cp + ep + dp + pp + bubble + optim. Not modelled: embedding lookup, kernel launch
overheads beyond alpha, imbalance between ranks other than the busiest stage, fine_grain_interleave, the lower
efficiency of small micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..plan import Plan
    from .model import ModelSpec
    from .space import Layout

HIDE = 0.7  # share of the hideable tp communication multi-copy interleave hides (NOTES.md: 67-72% measured)
TERMS = ("compute", "tp", "cp", "ep", "dp", "pp", "bubble", "optim")


@dataclass(frozen=True)
class Links:
    """Per-device figures: bandwidths in bytes/s (bus bandwidth of one rank), FLOP/s, latency in seconds."""

    intra_bw: float = 200e9      # NVLink-class
    inter_bw: float = 25e9       # one 200 Gb/s InfiniBand NIC per GPU
    devices_per_node: int = 8
    flops: float = 400e12        # H100-class dense bf16 matmul rate a well-tuned kernel reaches
    mfu: float = 0.4             # share of `flops` a training step achieves
    latency: float = 10e-6       # per collective call (alpha)
    layer_call_s: float = 3e-4   # fixed cost of one decoder layer's forward + backward call (launches, Python)
    adam_s_per_param: float = 1.2e-11  # AdamW update time per local parameter (~40 B of HBM traffic at 3 TB/s)
    shared_cores: int = 0        # > 0: the ranks take turns on this many cores (a CPU run): a rank waiting in the
    #                              pipeline bubble hands its core to the others, so only cores/world of it is lost

    def bw(self, span: int) -> float:
        return self.intra_bw if span <= self.devices_per_node else self.inter_bw


def _ar(nbytes: float, n: int, bw: float) -> float:
    """Ring all-reduce time (bus bytes 2 (n-1)/n)."""
    return 2 * (n - 1) / n * nbytes / bw if n > 1 else 0.0


def stage_layer_counts(plan: "Plan", spec: "ModelSpec") -> list[int]:
    """Decoder layers of each pipeline rank (all virtual chunks)."""
    if plan.layers_per_stage:
        return [sum(col) for col in zip(*plan.layers_per_stage)]
    return [spec.layers]


def recomputed_share(plan: "Plan", ls: int) -> float:
    rc = plan.recompute
    if rc.mode == "full":
        return 1.0
    if rc.mode == "layers" and rc.layers:
        return min(ls, max(sum(col) for col in zip(*rc.layers))) / max(ls, 1)
    return 0.0


def step_cost(spec: "ModelSpec", lay: "Layout", plan: "Plan", links: Links) -> dict[str, float]:
    """The step-time breakdown (seconds) of TERMS plus 'total'; see the module docstring for every formula."""
    t, c, p, d, e, v = lay.tp, lay.cp, lay.pp, lay.dp, lay.ep, plan.pp_virtual_stages
    u = plan.mesh.cp_ulysses
    r = c // u
    B = 2 if plan.compute_dtype in ("bf16", "fp16") else 4
    b = plan.micro_batch_size * plan.micro_batch_interleave_num
    m = plan.micro_batch_num if p > 1 else plan.gradient_accumulation_steps
    s, h, L = spec.seq_length, spec.hidden, spec.layers
    F = links.flops * links.mfu
    per_stage = stage_layer_counts(plan, spec)
    ls = max(per_stage)
    rc = recomputed_share(plan, ls)
    p_layer = (spec.dense_layer_params * (L - spec.moe_layers) + spec.moe_layer_params * spec.moe_layers) / L
    attn_mb = 12 * h * b * s * s / (t * c) / F
    layer_mb = 6 * p_layer * b * s / (t * c) / F + attn_mb
    # every micro-batch (and multi-copy copy) calls each of the stage's layers once forward and backward
    layer_all = layer_mb * (1 + rc / 3) + lay.mbi * (1 + rc / 2) * links.layer_call_s
    head = 6 * spec.vocab * h * b * s / (t * c) / F  # the output head, on the last stage only
    stage_work = [n * layer_all + (head if j == len(per_stage) - 1 else 0.0) for j, n in enumerate(per_stage)]
    # own devices: the busiest stage sets the pace; ranks sharing cores: the machine's total work does
    compute_mb = sum(stage_work) / len(stage_work) if links.shared_cores and p > 1 else max(stage_work)
    compute = m * compute_mb
    fwd_again = 1 + rc / 2  # recompute repeats the forward half of a layer's communication
    alpha = links.latency

    tp = 0.0
    if t > 1:
        x = b * (s / c) * h * B
        per = 8 * (t - 1) / t * x / links.bw(t) + 8 * alpha * lay.mbi
        tp = m * ls * per * fwd_again * (1 - HIDE * (lay.mbi - 1) / lay.mbi)

    cp = 0.0
    if c > 1:
        if r > 1:
            y = 2 * b * (s / c) * spec.kv_dim * B / min(t, spec.kv_heads)
            ring = 3 * (r - 1) * (y / links.bw(c * t) + alpha * lay.mbi)
            hidden = 0.0 if links.shared_cores else attn_mb  # ranks sharing cores overlap nothing
            cp += max(0.0, ring - hidden)
        if u > 1:
            z = 2 * (u - 1) / u * b * (s / c) * (h + spec.kv_dim) * B / t
            cp += z / links.bw(u * t) + 8 * alpha * lay.mbi
        cp *= m * ls * fwd_again

    ep = 0.0
    if e > 1 and spec.moe:
        n_tok = b * s / c / (t if lay.sp else 1)
        moe_ls = ls * spec.moe_layers / L
        ep = m * moe_ls * (4 * (e - 1) / e * n_tok * spec.top_k * h * B / links.bw(e) + 4 * alpha * lay.mbi)

    dp = _dp_cost(plan, lay, links, B, m, ls, compute_mb)

    pp = bubble = 0.0
    if p > 1:
        zb = b * (s / c) * h * B / (t if lay.sp else 1)
        pp = m * 2 * v * (zb / links.bw(d * c * t + 1) + alpha)
        f = (p - 1) / (v * m)
        if plan.pp_schedule == "zero_bubble_v":
            f *= max(0.0, 1 - m / (2 * p))
        busy = compute + tp + cp + ep
        bubble = f * busy
        world = d * c * t * p
        if 0 < links.shared_cores < world:
            # ranks take turns on K cores: the step is the longer of the busiest rank's path at a whole core's speed
            # (K/world of the shared-core time, bubble included) and the machine's total work (busy)
            bubble = max(0.0, links.shared_cores / world * busy * (1 + f) - busy)
    optim = 0.0
    if plan.memory is not None:  # the optimizer updates this rank's share (ZeRO >= 1: 1/(dp x cp) of it)
        mem = plan.memory
        dense, experts = mem.params_per_rank - mem.expert_params_per_rank, mem.expert_params_per_rank
        z = plan.zero.stage
        local = dense / (d * c if z >= 1 else 1) + experts / (plan.expert_data_parallel if z >= 1 else 1)
        optim = local * links.adam_s_per_param
    out = {"compute": compute, "tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp, "bubble": bubble, "optim": optim}
    out["total"] = sum(out.values())
    return out


def _dp_cost(plan: "Plan", lay: "Layout", links: Links, B: int, m: int, ls: int, compute_mb: float) -> float:
    mem = plan.memory
    if mem is None:
        return 0.0
    n, edp = lay.dp * lay.cp, plan.expert_data_parallel
    bw = links.bw(lay.dp * lay.cp * lay.tp)
    dense = mem.params_per_rank - mem.expert_params_per_rank
    g = _ar(dense * B, n, bw) + _ar(mem.expert_params_per_rank * B, edp, bw)
    if g == 0:
        return 0.0
    bwd = compute_mb * 2 / 3
    buckets = max(plan.config.parallel_config.gradient_aggregation_group, 1)
    z = plan.zero.stage
    if links.shared_cores:  # gloo on the cores the compute uses: nothing overlaps; the step-end collectives
        # (ZeRO 0: all-reduce; 1/2: reduce-scatter + all-gather) come after the whole backward
        calls = {0: 1, 1: 2, 2: 2}.get(z, 3 * m * (9 * ls + 3))
        return (g if z < 3 else m * g + g / 2) + calls * links.latency
    if z == 0:
        return max(g - bwd, g / buckets)
    if z in (1, 2):
        return max(g / 2 - bwd, g / 2 / buckets) + g / 2
    # DeepSpeed ZeRO-3 gathers (forward, backward) and reduce-scatters each parameter tensor on its own: 3 calls
    # per tensor and micro-batch (about 9 tensors a layer), latency-bound for small models
    calls = 3 * m * (9 * ls + 3) * links.latency
    return max(0.0, m * g + g / 2 - m * compute_mb) + g / (2 * max(ls, 1)) + calls


def why(costs: dict[str, float]) -> str:
    """The dominant terms, as shares of the step."""
    total = costs["total"] or 1.0
    top = sorted(((costs[k], k) for k in TERMS if costs[k] > 0), reverse=True)[:3]
    return ", ".join(f"{k} {100 * x / total:.0f}%" for x, k in top)
