"""Vocab parallel (MindFormers vocab_emb_dp: false): embedding rows, output-head rows and the softmax split over tp.

Rank r of the tp group owns token ids [r*V/tp, (r+1)*V/tp). Full-vocab logits are never gathered: the loss needs
only three numbers per token from each rank (max, sum of exp, the target's logit). The vocab size must be
divisible by tp: a clear error otherwise, no silent padding, because padded logits would change the softmax and so
the loss against the HF model. To pad on purpose, resize the model first
(model.resize_token_embeddings(n, pad_to_multiple_of=tp)), or keep vocab_emb_dp: true.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributed.collectives import all_reduce
from ..labels import IGNORE_INDEX
from .layers import ColumnParallelLinear, _cut, divide
from .mappings import gather_from_region, reduce_from_region, reduce_scatter_to_sequence_region
from .spec import STYLE_PARAM_SHARDS

__all__ = ["VocabParallelEmbedding", "check_ids_in_vocab", "vocab_parallel_cross_entropy", "ParallelLMHead",
           "ReplicatedLMHead"]

_VOCAB_FIX = ("; or pad the vocab (model.resize_token_embeddings(n, pad_to_multiple_of=tp)), or keep "
              "vocab_emb_dp: true")


def check_ids_in_vocab(ids: Tensor, vocab: int, what: str, ignore_index: int | None = None) -> None:
    """A clear error for the first id outside [0, vocab) (ignore_index allowed): with the vocab sharded such an id
    would silently become a zero embedding or a 0 logit, where one process raises IndexError. Every tp rank holds
    the same ids, so each raises the same error before any collective. One min/max read per call."""
    if ids.numel() == 0:
        return
    valid = ids if ignore_index is None else ids.masked_fill(ids == ignore_index, 0)
    lo, hi = torch.aminmax(valid)
    if int(lo) >= 0 and int(hi) < vocab:
        return
    bad = (valid < 0) | (valid >= vocab)
    pos = tuple(int(i) for i in bad.nonzero()[0])
    allowed = "" if ignore_index is None else f" or ignore_index={ignore_index}"
    raise ValueError(f"{what}: token id {int(ids[pos])} at position {pos} (of shape {tuple(ids.shape)}) is outside "
                     f"the vocab [0, {vocab}){allowed}; {int(bad.sum())} id(s) out of range. Fix the data or the "
                     f"tokenizer (ids must be < vocab_size={vocab}), or resize the model's embeddings")


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with rows split over `group`: weight [V/tp, dim], parameter name `weight`.

    Ids outside this rank's rows look up row 0 and are zeroed, then the group sums (each id has exactly one owner).
    An id outside [0, num_embeddings) is a ValueError naming it and its position (check_ids_in_vocab).
    With sequence_parallel the sum is a reduce-scatter along seq_dim: the output is this rank's sequence slice, as
    the SP residual stream expects.
    """

    _shard = STYLE_PARAM_SHARDS["vocab_embedding"]["weight"]

    def __init__(self, num_embeddings: int, embedding_dim: int, group, padding_idx: int | None = None, *,
                 sequence_parallel: bool = False, seq_dim: int = 1, device=None, dtype=None):
        super().__init__()
        self.group, self.tp, self.tp_rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        per = divide(num_embeddings, self.tp, "VocabParallelEmbedding: num_embeddings (vocab size)", _VOCAB_FIX)
        self.vocab_start, self.vocab_end = self.tp_rank * per, (self.tp_rank + 1) * per
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx={padding_idx} must be within num_embeddings={num_embeddings}")
            padding_idx %= num_embeddings  # nn.Embedding accepts negative indices
        self.padding_idx = padding_idx
        # Only the owner of the padding row keeps its grad at zero (F.embedding's padding_idx is a local row).
        own = padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end
        self._local_padding_idx = padding_idx - self.vocab_start if own else None
        self.weight = self._shard.parameter(torch.empty(per, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)  # nn.Embedding's init; the padding row starts at zero like there
        if self._local_padding_idx is not None:
            with torch.no_grad():
                self.weight[self._local_padding_idx].zero_()

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group, **kwargs) -> VocabParallelEmbedding:
        """This rank's rows of `embedding` (a clean copy: `embedding` can be freed)."""
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise ValueError("VocabParallelEmbedding supports plain embeddings only (no max_norm, "
                             "scale_grad_by_freq or sparse)")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, embedding.padding_idx, device="meta",
                    dtype=embedding.weight.dtype, **kwargs)
        w = embedding.weight
        layer.weight = _cut(w, cls._shard, layer.tp, layer.tp_rank)
        return layer

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp == 1:
            return F.embedding(ids, self.weight, self._local_padding_idx)
        check_ids_in_vocab(ids, self.num_embeddings, "VocabParallelEmbedding (vocab_emb_dp: false) input_ids")
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        out = F.embedding((ids - self.vocab_start).masked_fill(outside, 0), self.weight, self._local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0)  # also zeroes row 0's grad from those ids
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(out, self.group, self.seq_dim)
        return reduce_from_region(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp}, rows=[{self.vocab_start}, "
                f"{self.vocab_end}), padding_idx={self.padding_idx}, sequence_parallel={self.sequence_parallel}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocab-sharded logits (fp32 math). Forward: all-reduce max, then one all-reduce of
    (sum of exp, target logit). Backward (Megatron): softmax - onehot(target) on the owner's shard, times the grad;
    nothing communicated. Ignored tokens: loss 0, grad 0."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group, vocab_start: int, ignore_index: int) -> Tensor:
        x = logits.float()
        m = all_reduce(x.max(dim=-1, keepdim=True).values, group, dist.ReduceOp.MAX)
        x = x - m  # a new tensor (never the caller's logits), reused below for exp and softmax in place
        valid = target != ignore_index
        local = target - vocab_start
        owned = valid & (local >= 0) & (local < x.shape[-1])
        local = local.masked_fill(~owned, 0)
        picked = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0)
        exp = x.exp_()
        sum_exp, picked = all_reduce(torch.stack([exp.sum(-1), picked]), group)  # one collective for both sums
        loss = (sum_exp.log() - picked).masked_fill(~valid, 0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, owned, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):
        softmax, local, owned, valid = ctx.saved_tensors
        grad = grad.float()
        out = softmax * grad.masked_fill(~valid, 0).unsqueeze(-1)
        out.scatter_add_(-1, local.unsqueeze(-1), -grad.masked_fill(~owned, 0).unsqueeze(-1))  # the onehot term
        return out.to(ctx.dtype), None, None, None, None


class ReplicatedLMHead(nn.Linear):
    """The output head whole on every tp rank (vocab_emb_dp) under sequence parallel: the sequence-sharded hidden
    states are all-gathered, then the full GEMM; backward keeps this rank's slice of the input grad (every rank
    computed the same loss, so nothing is summed). The same parameters as the nn.Linear it replaces (a tied
    embedding stays tied). `producer`: a producer of the input whose tokens are not in sequence order, or that
    overlaps the gather (the interleave, multi_copy._Head), runs the gather and the GEMM as producer(head, x)."""

    gather_kind = "gather_replicated"  # interleave.overlap's kind: all-gather, backward this rank's slice
    producer: Optional[Callable[[nn.Module, Tensor], Tensor]] = None

    def __init__(self, linear: nn.Linear, group, seq_dim: int = 1):
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.group, self.seq_dim = (linear.in_features, linear.out_features,
                                                                         group, seq_dim)
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.producer is not None:
            return self.producer(self, x)
        return F.linear(gather_from_region(x, self.group, self.seq_dim), self.weight, self.bias)


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, group, ignore_index: int = IGNORE_INDEX,
                                 reduction: str = "mean") -> Tensor:
    """F.cross_entropy over the full vocab, from this rank's logits shard [..., V/tp] (rank r: ids r*V/tp...) and
    the full target [...] (same on every tp rank). reduction: "mean" over non-ignored tokens (nan if none, like
    torch), "sum", or "none" (shape of target, 0 at ignored tokens). The loss is fp32 whatever the logits dtype."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}: expected 'mean', 'sum' or 'none'")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits shard {tuple(logits.shape)} and target {tuple(target.shape)} must agree on every "
                         f"dim but the last (vocab)")
    check_ids_in_vocab(target, logits.shape[-1] * dist.get_world_size(group),
                       "vocab_parallel_cross_entropy (vocab_emb_dp: false) targets (the engines pass the labels "
                       "shifted by one: target (r, t) is label (r, t+1))", ignore_index)
    vocab_start = dist.get_rank(group) * logits.shape[-1]
    loss = _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start, ignore_index)
    if reduction == "none":
        return loss
    total = loss.sum()
    return total if reduction == "sum" else total / (target != ignore_index).sum()


class ParallelLMHead(ColumnParallelLinear):
    """The output head with its vocab rows split over `group`: logits stay sharded [..., V/tp] for
    vocab_parallel_cross_entropy (gather_output is always False). With sequence_parallel the hidden states arrive
    sequence-sharded and are all-gathered first, so logits and target cover the whole sequence."""

    _style = "vocab_lm_head"
    _divide_hint = _VOCAB_FIX
    producer: Optional[Callable[[nn.Module, Tensor], Tensor]] = None  # see ReplicatedLMHead

    def __init__(self, in_features: int, vocab_size: int, bias: bool, group, *, sequence_parallel: bool = False,
                 seq_dim: int = 1, device=None, dtype=None):
        super().__init__(in_features, vocab_size, bias, group, gather_output=False,
                         sequence_parallel=sequence_parallel, seq_dim=seq_dim, device=device, dtype=dtype)
        self.gather_kind = "all_gather" if sequence_parallel else None  # backward: reduce-scatter

    def forward(self, x: Tensor) -> Tensor:
        if self.producer is not None and self.gather_kind is not None:
            return self.producer(self, x)
        return super().forward(x)

    def loss(self, hidden: Tensor, target: Tensor, ignore_index: int = IGNORE_INDEX, reduction: str = "mean") -> Tensor:
        return vocab_parallel_cross_entropy(self(hidden), target, self.group, ignore_index, reduction)

    def gather_logits(self, logits_shard: Tensor) -> Tensor:
        """Full-vocab logits (for generation/eval only; training never needs them)."""
        return gather_from_region(logits_shard, self.group, -1)
