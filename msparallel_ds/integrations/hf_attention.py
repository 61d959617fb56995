"""Context-parallel attention as a HF `AttentionInterface` backend.

HF calls fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs) with query
[b, h, s, d] and key/value [b, h_kv, s, d] (not repeated) and expects (out [b, s, h, d], None). The model then
runs on this rank's sequence shard (see context_parallel.batch.shard_batch); RoPE uses the sharded
position_ids, so every token keeps its global position. Causality is global and handled here, so the matching
mask function returns no mask.
"""
from __future__ import annotations

from typing import Optional

DEFAULT_NAME = "msparallel_cp"


def _no_mask(*args, **kwargs):
    return None  # causal structure across the cp split is applied inside the attention itself


def make_cp_attention(layout, algo: Optional[str] = None, backend: Optional[str] = None):
    from ..context_parallel.api import context_parallel_attention

    def cp_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        if dropout and module.training:
            raise ValueError("context-parallel attention has no attention dropout; set attention_dropout: 0.0")
        if attention_mask is not None:
            raise ValueError("context-parallel attention got a dense attention_mask; shard the batch with "
                             "msparallel_ds.context_parallel.batch.shard_batch (padding masks are not supported)")
        out = context_parallel_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), layout,
                                         causal=getattr(module, "is_causal", True), softmax_scale=scaling,
                                         algo=algo, backend=backend)
        return out, None

    return cp_attention


def register_cp_attention(layout, name: str = DEFAULT_NAME, *, algo: Optional[str] = None,
                          backend: Optional[str] = None) -> str:
    """Register CP attention for `layout` under `name` (re-registering replaces the layout)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, make_cp_attention(layout, algo, backend))
    AttentionMaskInterface.register(name, _no_mask)
    return name


def use_cp_attention(model, layout, name: str = DEFAULT_NAME, **kwargs):
    """Register and switch a HF model (Llama/Qwen2/Mistral family) to context-parallel attention."""
    register_cp_attention(layout, name, **kwargs)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name
    return model
