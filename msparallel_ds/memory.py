"""Per-rank memory estimate for a Llama-family decoder under a Plan (pure arithmetic, in GiB).

Assumptions (stated so the numbers can be checked):
- Parameters per layer: model_params.py (Llama or Multi-head Latent Attention, SwiGLU MLP 3*h*ffn with ffn =
  ffn_hidden_size or 8h/3 rounded up to 256, two norms 2h; MoE and MTP layers; GLM's and GPT-2's biases, head dim,
  extra norms, plain MLP); embedding (+ a learned position table) and the output head V*h each (+ the final norm),
  split over tp when vocab parallel; a tied head counted once when pp == 1. The worst rank holds the busiest
  pipeline stage plus the embedding (first stage) or the head; with MTP layers and pp > 1 the last stage holds the
  embedding too.
- Bytes: weights and gradients in the compute dtype (bf16/fp16: 2, fp32: 4). Optimizer state: Adam's m and v in
  fp32 (8 bytes/param) plus an fp32 master copy (4) in mixed precision, and also in fp32 under DeepSpeed ZeRO 1-2
  (stage_1_and_2.py clones its fp32 partition whatever the dtype). ZeRO-1 divides optimizer state, ZeRO-2 also
  gradients, ZeRO-3 also weights, by dp x cp. pp > 1 runs on the pipeline engine (torch ZeroRedundancyOptimizer over
  dp x cp, no master copy in fp32): optimizer_level level2/level3 act as level1 there, so gradients stay whole.
- Buffers: DeepSpeed ZeRO 1-2 (pp 1) allocate reduce_bucket_size gradient elements per bucket, two with overlap_comm
  (setup_buckets; a fixed size, not a share of the model). The pipeline engine's stages keep one receive buffer per
  micro-batch for the stage input (not on the first stage) and one for its gradient (not on the last), s*b*h each
  (/t with sequence parallel); its gradient all-reduce flattens copies of the dense gradients (dp x cp > 1), then of
  the experts' (edp > 1), one bucket of at most reduce_bucket_size elements at a time, after the activations are
  gone: the total takes the larger of the two moments.
- Activations per layer and micro-batch, from what a HF Llama-family layer (RMSNorm, RoPE, SwiGLU, no dropout)
  saves for backward, with s = seq/cp, b = batch_size x micro_batch_interleave_num, h = hidden, f = ffn,
  kv = kv heads x head dim, a = heads, t = tp, n = compute-dtype bytes, per token:
  2 norms x h x (4 + n) (the fp32 input and the normalized x; /t with sequence parallel), 2 norm outputs x h x n
  (the QKV and gate/up inputs: whole, all-gathered under sequence parallel), (2h + 2kv + 4f) x n / t (q and k after
  RoPE, v, the attention output; gate, up, silu(gate) and their product), and without flash attention the fp32
  softmax a*s/t (+ its n-byte cast when n < 4). With MLA, 2h + 2kv becomes 2a(nope+rope) + 2a*v (q, k; v and the
  output projection's input); the low-rank latents are not counted. MTP layers count as decoder layers of the last
  stage (mcore places them outside the layer split). Full recompute keeps only the layer input, h x n
  (/t with sequence parallel). Pipeline 1F1B keeps min(micro_batch_num, pp - stage) micro-batches in flight on
  stage `stage` (all of them for GPipe); pp 1 holds one micro-batch.
- Logits (last stage): at the loss backward the fp32 log-softmax, its gradient and the logits' gradient are live
  together: 3 x 4 x s*b*V bytes (/t when vocab parallel). Allocator fragmentation and communication scratch space
  of the collectives are not counted.
- MoE (plan.moe with an expert count; moe.plan.stage_params): MoE layers (all but the first first_k_dense_replace)
  hold a router (E*h, replicated), shared experts (3*h*shared size, split over tp like the dense feed-forward) and
  E/ep whole routed experts of 3*h*expert size each (moe_intermediate_size, else ffn). Expert weights, gradients and
  optimizer state are ZeRO-sharded over the expert-data-parallel group (dp*cp*tp/ep) instead of dp x cp. The worst
  rank is the pipeline stage with the most state bytes. MoE activations use the dense formula above.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Optional

from .model_params import dense_layer, embedding_params, ffn_size, head_params, mla_dims
from .moe.plan import stage_layer_kinds, stage_params

if TYPE_CHECKING:
    from .config.schema import ParallelConfig
    from .plan import Plan

GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryEstimate:
    params_per_rank: int
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    activations_no_recompute_gib: float
    logits_gib: float
    total_gib: float
    expert_params_per_rank: int = 0  # routed-expert parameters among params_per_rank
    buffers_gib: float = 0.0  # DeepSpeed's reduce buckets, or the pipeline stages' receive buffers
    grad_sync_gib: float = 0.0  # the pipeline engine's flat gradient copy at its all-reduce (after activations)

    def as_dict(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def param_counts(cfg: "ParallelConfig") -> Optional[tuple[int, int]]:
    """(parameters of a dense decoder layer, embedding-or-head parameters), or None when the shape is unknown."""
    m = cfg.model
    if None in (m.num_layers, m.hidden_size, m.num_heads, m.vocab_size):
        return None
    return dense_layer(cfg).total, max(embedding_params(m), head_params(m))


def estimate_memory(plan: "Plan", stage: Optional[int] = None) -> Optional[MemoryEstimate]:
    """The worst rank's memory (stage None: the busiest stage's layers and state, charged one embedding or head and
    the first stage's in-flight micro-batches: an upper bound), or pipeline stage `stage`'s own: the embedding on
    the first stage, the head and logits on the last, 1F1B's min(micro_batch_num, pp - stage) in flight."""
    cfg = plan.config
    m = cfg.model
    counts = param_counts(cfg)
    if counts is None or m.seq_length is None:
        return None
    mesh = plan.mesh
    t, p = mesh.tp, mesh.pp
    kinds = stage_layer_kinds(plan)
    vocab_split = t if plan.vocab_parallel else 1
    # pp == 1: embedding and head both here (a tied head counted once); pp > 1: one of them on the worst stage (a
    # tied head's copy on the last), and the last stage's MTP layers need the embedding beside the head
    first, last_side = embedding_params(m, vocab_split), head_params(m, vocab_split, beside_embedding=p == 1)
    embed_params = first + last_side if p == 1 else max(first, last_side)
    mtp_embed = m.vocab_size * m.hidden_size // vocab_split if p > 1 and m.mtp_depth else 0
    wbytes = 2 if plan.compute_dtype in ("bf16", "fp16") else 4
    z, shard, edp = plan.zero.stage, mesh.dp * mesh.cp, plan.expert_data_parallel
    if p > 1:  # the pipeline engine: ZeRO-1 at most (level2/3 run as level1), torch's AdamW on the weights
        z = min(z, 1)
    obytes = 12 if wbytes == 2 or (p == 1 and z in (1, 2)) else 8

    def states(params: int, experts: int) -> tuple[float, float, float]:  # weights, grads, optimizer (bytes)
        return tuple(n * (params / (shard if z >= level else 1) + experts / (edp if z >= level else 1))
                     for n, level in ((wbytes, 3), (wbytes, 2), (obytes, 1)))

    last = len(kinds) - 1
    if stage is not None:  # this stage's own: embedding first, head (+ MTP's embedding) last
        embed_params = (first if stage == 0 else 0) + (last_side if stage == last else 0)
        kinds = [kinds[stage]]
    stages = [(d + embed_params + (mtp_embed if j == last else 0), e)
              for j, (d, e) in enumerate(stage_params(plan)) if stage is None or j == stage]
    params, experts = max(stages, key=lambda pe: sum(states(*pe)))
    stage_layers = max(sum(k) for k in kinds)
    weights, grads, optim = states(params, experts)

    s = m.seq_length // mesh.cp
    b = plan.micro_batch_size * plan.micro_batch_interleave_num
    h, a, n = m.hidden_size, m.num_heads, wbytes
    sp = t if plan.sequence_parallel else 1
    mla = mla_dims(m)
    # q and k after RoPE, v and the attention output (elements per token), then SwiGLU's four ffn-wide tensors
    qkv = 2 * a * (mla["nope"] + mla["rope"] + mla["v"]) if mla else 2 * h + 2 * m.kv_heads * (h // a)
    per_token = 2 * h * (4 + n) / sp + 2 * h * n + (qkv + 4 * ffn_size(cfg)) * n / t
    if not m.use_flash_attention:
        per_token += a * s * (4 + (n if n < 4 else 0)) / t
    layer_act = per_token * s * b
    layer_ckpt = h * n * s * b / sp
    in_flight = 1 if p == 1 else (plan.micro_batch_num if plan.pp_schedule == "gpipe"
                                  else min(plan.micro_batch_num, p - (stage or 0)))
    no_recompute = stage_layers * layer_act * in_flight
    rc = plan.recompute
    if rc.mode == "full":
        recomputed = stage_layers
    elif rc.mode == "layers" and rc.layers:
        cols = list(zip(*rc.layers))
        recomputed = min(stage_layers, sum(cols[stage]) if stage is not None and stage < len(cols)
                         else max(sum(col) for col in cols))
    else:
        recomputed = 0
    act = ((stage_layers - recomputed) * layer_act + recomputed * layer_ckpt) * in_flight
    logits = 3 * 4 * s * b * m.vocab_size / vocab_split if stage in (None, last) else 0.0
    if p == 1:
        buffers = (2 if plan.zero.overlap_comm else 1) * plan.zero.reduce_bucket_size * wbytes if z in (1, 2) else 0
        sync = 0.0
    else:  # receive buffers: input (not stage 0) and gradient (not the last stage); stage None: a middle one
        ends = 2 if stage is None else (stage > 0) + (stage < last)
        buffers = min(ends, p - 1 if stage is None else 2) * plan.micro_batch_num * s * b * h * n / sp
        # all_reduce_flat: a flat copy of one bucket of the dense gradients (over dp x cp), then of the experts'
        bucket = plan.zero.reduce_bucket_size
        sync = wbytes * max(min(params, bucket) if shard > 1 else 0, min(experts, bucket) if edp > 1 else 0)
    total = weights + grads + optim + max(act + logits + buffers, sync)
    return MemoryEstimate(params_per_rank=int(params + experts), weights_gib=weights / GIB, grads_gib=grads / GIB,
                          optimizer_gib=optim / GIB, activations_gib=act / GIB,
                          activations_no_recompute_gib=no_recompute / GIB, logits_gib=logits / GIB,
                          total_gib=total / GIB, expert_params_per_rank=int(experts), buffers_gib=buffers / GIB,
                          grad_sync_gib=sync / GIB)


_SHAPE_KEYS = ("num_layers", "num_heads", "hidden_size", "vocab_size", "seq_length")


def missing_shape_note(cfg) -> Optional[str]:
    """Why the plan has no memory estimate (or layer split): the model_config keys it lacks, and where the YAML
    says the shape lives when it points at a model directory that `plan` does not read."""
    missing = [k for k in _SHAPE_KEYS if getattr(cfg.model, k) is None]
    if not missing:
        return None
    where = (f"; the YAML takes the model from pretrained_model_dir={cfg.pretrained_model_dir!r}, which the plan "
             "does not read" if cfg.pretrained_model_dir else "")
    return (f"no memory estimate or layer split: model.model_config lacks {', '.join(missing)}{where}; add them to "
            "model.model_config to get both")


def shape_notes(cfg: "ParallelConfig") -> list[str]:
    """What the estimate counts of Multi-head Latent Attention and multi-token prediction, when the model has them."""
    m, parts = cfg.model, []
    d = mla_dims(m)
    if d:
        q = f"q_lora {d['q_lora']}" if d["q_lora"] else "no q_lora (one q projection)"
        parts.append(f"MLA attention: {q}, kv_lora {d['kv_lora']} (latent KV cache {d['kv_lora'] + d['rope']} per "
                     f"token), rope {d['rope']}, nope {d['nope']}, v {d['v']}; q_a / kv_a projections and their norms "
                     "replicated on every tp rank")
    if m.mtp_depth:
        where = "counted in the layer split (legacy)" if cfg.use_legacy else "outside the layer split (mcore)"
        loss = f", loss x{m.mtp_loss_factor:g}" if m.mtp_loss_factor is not None else ""
        parts.append(f"MTP: {m.mtp_depth} layer(s) on the last stage, {where}{loss}")
    return ["; ".join(parts)] if parts else []


_UNITS = {"": 1.0, "B": 2.0 ** -30, "K": 2.0 ** -20, "KB": 2.0 ** -20, "M": 2.0 ** -10, "MB": 2.0 ** -10,
          "G": 1.0, "GB": 1.0, "T": 1024.0, "TB": 1024.0}


def parse_memory_gib(value: Any) -> Optional[float]:
    """MindSpore's context.max_device_memory ("58GB", "1024MB", 58) -> GiB; None when it cannot be read."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) if value > 0 else None
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?B?)\s*", str(value), re.IGNORECASE)
    if not found:
        return None
    gib = float(found.group(1)) * _UNITS[found.group(2).upper()]
    return gib if gib > 0 else None


def max_device_memory_gib(raw: Any) -> Optional[float]:
    """A MindFormers YAML's context.max_device_memory (the raw mapping), in GiB; None when absent or unreadable."""
    ctx = raw.get("context") if isinstance(raw, dict) else None
    value = ctx.get("max_device_memory") if isinstance(ctx, dict) else None
    return parse_memory_gib(value) if value is not None else None

