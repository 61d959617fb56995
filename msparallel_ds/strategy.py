"""msp.parallelize(model, layout): the YAML's strategy applied to a HF decoder, in one place.

(The module is not named `parallelize`: a submodule of that name would replace the function `msp.parallelize` as
an attribute of the package as soon as it is imported.)

Order matters: tensor/sequence/vocab parallel first (it replaces Linear/Embedding modules), then context-parallel
attention (an attention-function switch, no module change), then recompute (wraps forwards of the final modules).
Every option defaults to the layout's Plan (use_seq_parallel, vocab_emb_dp, context_parallel_algo,
recompute_config); pass one to override it. The input sequence is sharded over cp by the caller
(`context_parallel.batch.shard_batch`, which msp.initialize's engine does for every micro-batch).
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

__all__ = ["parallelize"]


def _plan_value(layout, name: str, default: Any) -> Any:
    return getattr(getattr(layout, "plan", None), name, default)


def parallelize(model: nn.Module, layout, *, sequence_parallel: Optional[bool] = None,
                vocab_parallel: Optional[bool] = None, cp_algo: Optional[str] = None, recompute: Any = None,
                cp_backend: Optional[str] = None, copy_loss: str = "mean") -> nn.Module:
    """Shard `model` in place for `layout` and return it. Every rank must pass the same weights (same seed or
    checkpoint); each keeps only its shards. A model on the meta device is fine (load weights afterwards with
    msparallel_ds.weights.load_sharded_checkpoint, or use msp.from_pretrained).

    micro_batch_interleave_num / fine_grain_interleave > 1 (the Plan's) run the decoder layers as interleaved
    copies / token chunks (msparallel_ds.interleave). copy_loss: "mean" (default) keeps the non-interleaved
    step's gradient; "sum" is MindSpore's summed copies (each copy's token mean, summed; msp.initialize's engine
    applies it)."""
    from .recompute import apply_recompute
    from .tensor_parallel.apply import tp_parallelize

    done = getattr(model, "msp_layout", None)
    if done is not None:
        if done is not layout:
            raise ValueError("this model was already parallelized for another ParallelLayout; build a fresh model")
        return model
    if layout.size("pp") > 1:
        raise ValueError(f"parallel_config.pipeline_stage={layout.size('pp')}: msp.parallelize cannot pipeline a "
                         "model by itself; pass the plain HF model to msp.initialize(model, cfg, optimizer=...), whose "
                         "pipeline engine splits it into stages and runs the schedule (under torchrun or the "
                         "deepspeed launcher)")
    tp = layout.size("tp")
    sp = _plan_value(layout, "sequence_parallel", False) if sequence_parallel is None else sequence_parallel
    vocab = _plan_value(layout, "vocab_parallel", False) if vocab_parallel is None else vocab_parallel
    if tp > 1:
        tp_parallelize(model, layout, sequence_parallel=bool(sp), vocab_parallel=bool(vocab))
    if layout.size("cp") > 1:
        from .integrations.hf_attention import use_cp_attention

        use_cp_attention(model, layout, algo=cp_algo, backend=cp_backend)
    recompute = _plan_value(layout, "recompute", None) if recompute is None else recompute
    model.msp_recompute = apply_recompute(model, recompute, stage=layout.rank("pp"))
    copies = _plan_value(layout, "micro_batch_interleave_num", 1)
    chunks = _plan_value(layout, "fine_grain_interleave", 1)
    if copies > 1 or chunks > 1 or copy_loss != "mean":
        from .interleave.multi_copy import install

        install(model, copies, chunks, copy_loss=copy_loss)
    model.msp_layout = layout
    return model

