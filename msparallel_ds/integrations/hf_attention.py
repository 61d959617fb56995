"""Context-parallel attention as a HF `AttentionInterface` backend.

HF calls fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs) with query
[b, h, s, d] and key/value [b, h_kv, s, d] (not repeated) and expects (out [b, s, h, d], None). The model then
runs on this rank's sequence shard (see context_parallel.batch.shard_batch); RoPE uses the sharded
position_ids, so every token keeps its global position. Causality is global and handled here, so the matching
mask function returns no mask.

Packed rows: shard_batch returns a sharded `doc_ids` entry; pass it to the model (model(..., doc_ids=shard["doc_ids"])
or model(**shard)). transformers 5 forwards unknown model kwargs (TransformersKwargs) through the decoder layers to
the attention function, which hands them to context_parallel_attention for document-causal attention. A shard's
position_ids alone cannot place document boundaries that lie on other ranks, hence the explicit ids.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ..distributed.layout import ParallelLayout

DEFAULT_NAME = "msparallel_cp"


def _no_mask(*args, **kwargs):
    return None  # causal structure across the cp split is applied inside the attention itself


def _check_unpacked(position_ids, layout: ParallelLayout) -> None:
    """position_ids restarting at 0 anywhere but the sequence's first token (local token 0 of cp rank 0, in every
    algorithm's layout) mean packed documents; HF would mask them apart, so without doc_ids this is an error, not
    silent cross-document attention (it also catches unsharded position_ids: arange(s_local) on every rank).
    Only ranks holding a restart can see it: the others reach the collective and wait there until this error
    ends the job."""
    restart = position_ids == 0
    if layout.rank("cp") == 0:
        restart[..., 0] = False
    if bool(restart.any()):
        raise ValueError("position_ids restart at 0 inside the sequence but no doc_ids reached the context-parallel "
                         "attention: shard the batch with context_parallel.batch.shard_batch and pass its "
                         "position_ids and, for packed documents, its doc_ids to the model "
                         "(model(..., position_ids=shard['position_ids'], doc_ids=shard['doc_ids']))")


# where HF families keep attention-probability dropout: Llama/Qwen2/Mistral, GPT-2/GPT-J, BERT-likes, others
DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout",
                "attention_dropout_prob")


def dropout_key(module) -> Optional[str]:
    """The model config key that holds this attention's dropout (a non-zero one first), or None if unknown."""
    config = getattr(module, "config", None)
    found = [k for k in DROPOUT_KEYS if hasattr(config, k)]
    nonzero = [k for k in found if isinstance(getattr(config, k), (int, float)) and getattr(config, k)]
    return (nonzero or found or [None])[0]


def dropout_error(module, dropout: float) -> ValueError:
    key = dropout_key(module)
    fix = (f"set {key}=0.0 in the model config (e.g. AutoConfig.from_pretrained(name, {key}=0.0))" if key else
           f"set the model config's attention dropout ({', '.join(DROPOUT_KEYS[:2])}, ...) to 0.0")
    return ValueError(f"context-parallel attention has no attention dropout, but {type(module).__name__} asks for "
                      f"dropout={dropout} in training: {fix}, or train with context_parallel: 1")


def make_cp_attention(layout: ParallelLayout, algo: Optional[str] = None, backend: Optional[str] = None):
    from ..context_parallel.api import context_parallel_attention

    checked = [None]  # weakref to the last position_ids found unpacked: HF passes one tensor to every layer

    def cp_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        if dropout and module.training:
            raise dropout_error(module, dropout)
        if attention_mask is not None:
            raise ValueError("context-parallel attention got a dense attention_mask; shard the batch with "
                             "msparallel_ds.context_parallel.batch.shard_batch (padding masks are not supported)")
        window = kwargs.get("sliding_window")
        if window is not None and window < query.shape[2] * layout.size("cp"):
            raise ValueError(f"sliding_window={window} (Mistral/Qwen2 config) is shorter than the sequence "
                             f"({query.shape[2] * layout.size('cp')} tokens): context-parallel attention has no "
                             "sliding window; set sliding_window: null (or >= the sequence length) or "
                             "context_parallel: 1")
        doc_ids, position_ids = kwargs.get("doc_ids"), kwargs.get("position_ids")
        if doc_ids is None and position_ids is not None and (checked[0] is None or checked[0]() is not position_ids):
            _check_unpacked(position_ids, layout)  # one host sync per forward, not per layer
            checked[0] = weakref.ref(position_ids)
        out = context_parallel_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), layout,
                                         causal=getattr(module, "is_causal", True), softmax_scale=scaling,
                                         algo=algo, backend=backend, doc_ids=doc_ids)
        return out, None

    return cp_attention


def register_cp_attention(layout: ParallelLayout, name: str = DEFAULT_NAME, *, algo: Optional[str] = None,
                          backend: Optional[str] = None) -> str:
    """Register CP attention for `layout` under `name` (re-registering replaces the layout)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, make_cp_attention(layout, algo, backend))
    AttentionMaskInterface.register(name, _no_mask)
    return name


def use_cp_attention(model, layout: ParallelLayout, name: str = DEFAULT_NAME, **kwargs):
    """Register and switch a HF model (Llama/Qwen2/Mistral family) to context-parallel attention."""
    register_cp_attention(layout, name, **kwargs)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name
    return model
