"""Parameters of one decoder layer, by part, from the YAML's model shape (pure arithmetic; moe/plan.py sums them per
pipeline stage for memory.py). h = hidden_size, n = num_heads.

- Attention, Llama family: q, o = h*h each, k, v = h*kv each (kv = kv heads x h/n). With the block traits of
  config/model_traits.py (GLM, GPT-2): head dim d (q = n*d, kv = kv heads x d), q/k/v biases (split), per-head q/k
  norms 2d and the output projection's bias h (replicated); a non-gated MLP 2*h*ffn (+ ffn and h biases); norms with
  biases (LayerNorm) 2h each, two more norms with post_norms. Embedding V*h plus a learned position table P*h;
  the head V*h unless tied (counted once when embedding and head share a stage) plus the final norm.
- Attention, Multi-head Latent Attention (DeepSeek-V2/V3; on when model_config sets kv_lora_rank), as transformers'
  DeepseekV3Attention: q = h*q_lora + q_lora (q_a_layernorm) + q_lora*n*(nope+rope), or h*n*(nope+rope) when
  q_lora_rank is unset or 0; kv = h*(kv_lora+rope) (kv_a_proj_with_mqa) + kv_lora (kv_a_layernorm) +
  kv_lora*n*(nope+v) (kv_b_proj); o = n*v*h. Unset head dims take DeepseekV3Config's defaults (rope 64, nope 128,
  v 128). Tensor parallel splits the per-head projections (q_b / q, kv_b, o); the down-projections q_a and
  kv_a_with_mqa and their norms have no head dimension, so every tp rank holds them whole.
- Per layer also a SwiGLU feed-forward 3*h*ffn and two norms 2h, split over tp (the norms too, as memory.py always
  counted them). A MoE layer has a router E*h (replicated), shared experts 3*h*shared (split) and E routed experts
  of 3*h*expert size each, of which a rank holds E/ep whole.
- Multi-token prediction (mtp_depth): each MTP layer is one decoder layer of the model's last kind plus eh_proj
  2h*h (split over tp) and enorm, hnorm and a final norm, 3h (replicated); it shares the embedding and the output
  head with the model (memory.py charges the last stage an extra embedding when pp > 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config.schema import ModelShape, ParallelConfig
    from .moe.settings import MoESettings

MLA_HEAD_DIMS = {"qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}  # DeepseekV3Config defaults


@dataclass(frozen=True)
class Params:
    split: int = 0       # divided over the tensor-parallel ranks
    replicated: int = 0  # whole on every tensor-parallel rank

    def __add__(self, other: "Params") -> "Params":
        return Params(self.split + other.split, self.replicated + other.replicated)

    @property
    def total(self) -> int:
        return self.split + self.replicated

    def per_rank(self, tp: int) -> int:
        return self.split // tp + self.replicated


def ffn_size(cfg: "ParallelConfig") -> int:
    """The dense feed-forward size: ffn_hidden_size, or 8h/3 rounded up to 256."""
    return cfg.model.ffn_hidden_size or 256 * math.ceil(8 * cfg.model.hidden_size / 3 / 256)


def mla_dims(m: "ModelShape") -> dict[str, int]:
    """q_lora (0: none), kv_lora, rope, nope, v of a Multi-head Latent Attention model; {} for other attention."""
    if m.kv_lora_rank is None:
        return {}
    dims = {k: getattr(m, k) or d for k, d in MLA_HEAD_DIMS.items()}
    return {"q_lora": m.q_lora_rank or 0, "kv_lora": m.kv_lora_rank, "rope": dims["qk_rope_head_dim"],
            "nope": dims["qk_nope_head_dim"], "v": dims["v_head_dim"]}


def norm_size(m: "ModelShape") -> int:
    """One norm's parameters: weight (and LayerNorm's bias)."""
    return m.hidden_size * (2 if m.linear_bias else 1)


def attention(m: "ModelShape") -> Params:
    h, n = m.hidden_size, m.num_heads
    d = mla_dims(m)
    if not d:
        hd = m.head_dim or h // n
        q, kv = n * hd, m.kv_heads * hd
        bias = q + 2 * kv if m.qkv_bias or m.linear_bias else 0
        return Params(2 * h * q + 2 * h * kv + bias, (h if m.linear_bias else 0) + (2 * hd if m.qk_norm else 0))
    q_heads = n * (d["nope"] + d["rope"])
    q = Params(d["q_lora"] * q_heads, h * d["q_lora"] + d["q_lora"]) if d["q_lora"] else Params(h * q_heads)
    kv = Params(d["kv_lora"] * n * (d["nope"] + d["v"]), h * (d["kv_lora"] + d["rope"]) + d["kv_lora"])
    return q + kv + Params(n * d["v"] * h)


def _norms(m: "ModelShape") -> int:
    return (4 if m.post_norms else 2) * norm_size(m)


def dense_layer(cfg: "ParallelConfig") -> Params:
    m = cfg.model
    h, ffn = m.hidden_size, ffn_size(cfg)
    if not m.gated_mlp:  # fc -> act -> proj
        ffn_part = Params(2 * h * ffn + (ffn if m.linear_bias else 0), h if m.linear_bias else 0)
    else:
        ffn_part = Params(3 * h * ffn)
    return attention(m) + ffn_part + Params(_norms(m))


def moe_layer(cfg: "ParallelConfig", s: "MoESettings", ep: int) -> tuple[Params, int]:
    """(a MoE layer's parameters outside the routed experts, the routed-expert parameters of a rank holding E/ep)."""
    h, ffn = cfg.model.hidden_size, ffn_size(cfg)
    rest = attention(cfg.model) + Params(3 * h * s.shared_size(ffn) + _norms(cfg.model), s.num_experts * h)
    return rest, s.num_experts // ep * 3 * h * s.expert_size(ffn)


def embedding_params(m: "ModelShape", vocab_split: int = 1) -> int:
    """The first stage's input side: the word embedding (split when vocab parallel) and a learned position table."""
    return m.vocab_size * m.hidden_size // vocab_split + (m.position_embeddings or 0) * m.hidden_size


def head_params(m: "ModelShape", vocab_split: int = 1, *, beside_embedding: bool = False) -> int:
    """The last stage's output side: the final norm and the head (none of its own when tied to an embedding held
    on the same stage; pipeline stages without the embedding hold a copy)."""
    shared = m.tie_word_embeddings and beside_embedding
    return norm_size(m) + (0 if shared else m.vocab_size * m.hidden_size // vocab_split)


def mtp_extra(m: "ModelShape") -> Params:
    """What an MTP layer adds to its decoder layer: eh_proj, enorm, hnorm and the final norm."""
    return Params(2 * m.hidden_size * m.hidden_size, 3 * m.hidden_size)
