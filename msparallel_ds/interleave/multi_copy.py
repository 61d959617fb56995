"""micro_batch_interleave_num = N: the micro-batch's rows run as N copies through the decoder, layer by layer, so
one copy's tensor/sequence-parallel collective is in flight while another copy computes.

The schedule is written once, for any N: every copy is a generator (`copy_steps`) that runs the decoder layers as
steps (fine_grain.decoder_steps) and yields right after it has started a collective (overlap.issue, async_op=True);
`round_robin` resumes the copies in turn, and a copy waits for its collective only when it resumes and needs the
result. With SP, per layer and copy: [norm, all-gather, QKV of own rows] [wait, QKV of the others' rows, attention
of half the rows] [attention of the other half, out-proj, reduce-scatter, out-proj of own rows] [wait, residual,
norm, all-gather, gate/up of own rows] [wait, gate/up of the others' rows, act] [down-proj, reduce-scatter,
down-proj of own rows] (overlap: a gather's window holds the copy's own rows' GEMM, a reduce-scatter's too,
remote-first, where copies x chunks <= 2: fine_grain.remote_first). Copy c starts c % 3 steps behind copy 0
(copy_lag), so the step another copy runs inside a norm-step's window is a GEMM step, not the same short norm step
(in lockstep every second collective had only a norm to hide behind).

Backward needs no scheduler: eager autograd runs ready nodes in reverse creation order, so the interleaved forward
gives an interleaved backward. Each wait node's backward starts the transposed collective (reduce-scatter of the
input grad, all-gather of the output grad) and the matching issue node's backward, created before the other
copies' nodes, waits for it after their backward ran; the QKV and gate/up GEMMs' backward (overlap.wait_linears)
starts the input-grad collective before computing the weight grads.

What overlaps, honestly:
- tp with SP: the 2 all-gathers and 2 reduce-scatters per layer, forward and backward; tp without SP: the 2
  all-reduces per layer forward, the 2 input-grad all-reduces backward.
- cp: ring attention already overlaps its own K/V transfers with its block computations; here a copy's ring runs
  while other copies' tp collectives are in flight (the ring's transfers are not split into scheduler steps, so
  they do not overlap another copy's compute). cp-only layers (tp = 1) run whole, one copy after the other.
- dp: DeepSpeed's gradient reduction after backward is unchanged (it sees one backward of the whole micro-batch).
- Not interleaved: embedding, final norm, output head and loss run once on the whole micro-batch (the
  vocab-parallel embedding's all-reduce is blocking); recomputed layers, the weight-grad all-reduces of
  replicated kv / SP bias parameters (small, blocking, after all copies contributed). The SP norms' weight grads
  are summed async, one wait per backward (tensor_parallel/replicated.py).
- The ends under SP (_Head): the output head's input all-gather is async, its window the head's GEMM of this
  rank's own rows; with fine-grain chunks in the chunk layout the head takes the gathered blocks in sequence
  order, so the chunks need no all-to-all back. The model's layer-0 scatter (per copy) is async in backward: its
  all-gather runs beside the other copies' layer-0 backward and the replicated head's weight-grad GEMM, deferred
  to there (deferred.py, Megatron's defer_embedding_wgrad_compute).

Semantics: the copies are rows of one micro-batch and the engine's loss is the token sum over all of them divided
by the global token count, so the step's gradient equals the non-interleaved step's (a speed feature). MindSpore's
MicroBatchInterleaved instead SUMS the copies' losses (each copy's token mean), which scales gradients by about N;
`copy_loss="sum"` (msp.parallelize(model, layout, copy_loss="sum") before msp.initialize) reproduces it: each
micro-batch's loss is sum_c mean_c (copy c's token mean over its rows on this dp rank, all cp shards), averaged
over dp ranks and micro-batches, and the reported loss is divided by N as MindFormers logs it.

Hook: `install(part, n_copies, fine_grain)` hands the part's family adapter an InterleavedStack, which runs the
part's decoder layers: on a whole HF model its decoder loop sees the stack as its one layer (models.base.
InterleavedLayers), so HF still builds the embedding, position ids, RoPE and masks once for the whole micro-batch
and the stack splits them per copy (dim 0); a pipeline stage calls the stack on its own layers.
"""
from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from ..models import LayerParts, adapter_for
from ..tensor_parallel.layers import RowParallelLinear
from .deferred import DeferredWgrad
from .fine_grain import decoder_steps, join_chunks, resolve, split_rows
from .overlap import AsyncCollective, issue, wait_linears
from .schedule import round_robin, run

__all__ = ["COPY_LOSS_MODES", "InterleavedStack", "check_copy_loss", "copy_loss_terms", "install", "installed",
           "run_layers"]

COPY_LOSS_MODES = ("mean", "sum")


# ---------------------------------------------------------------------------------------------- one copy
def copy_lag(copy: int) -> int:
    """Steps copy `copy` runs behind copy 0: a half-layer is 3 steps (norm + gather, GEMMs, GEMM + reduce)."""
    return copy % 3


def copy_steps(layers: Sequence[tuple[int, nn.Module, Optional[LayerParts]]], h: Tensor, kw: dict, *, copy: int = 0,
               fine_grain: int = 1, scatter_group=None, stay_chunked: bool = False,
               wgrad: Optional[DeferredWgrad] = None, copies: int = 1):
    """Generator: one copy through `layers` ((index, layer, parts) each); yields after each collective it starts;
    returns (its hidden state, (tp, n) if it is in the chunk layout else None). scatter_group: the tp group when
    the first layer is the model's layer 0 under SP; stay_chunked, wgrad, copies: see fine_grain.decoder_steps."""
    hs, layout = yield from decoder_steps(list(layers), h, kw, n=fine_grain, copy=copy, lag=copy_lag(copy),
                                          scatter_group=scatter_group, stay_chunked=stay_chunked, wgrad=wgrad,
                                          copies=copies)
    return join_chunks([resolve(h) for h in hs]), layout


def _run_copies(layers, hidden_states_copies, copy_kwargs, *, fine_grain: int, scatter_group=None,
                stay_chunked: bool = False, wgrad: Optional[DeferredWgrad] = None,
                **layer_kwargs) -> tuple[list[Tensor], Optional[tuple[int, int]]]:
    n = len(hidden_states_copies)
    kws = [{**layer_kwargs, **(copy_kwargs[c] if copy_kwargs else {})} for c in range(n)]
    gens = [copy_steps(layers, hidden_states_copies[c], kws[c], copy=c, fine_grain=fine_grain,
                       scatter_group=scatter_group, stay_chunked=stay_chunked, wgrad=wgrad, copies=n)
            for c in range(n)]
    outs = run(round_robin(gens))  # every copy runs the same layers, so all share one output layout
    return [o for o, _ in outs], outs[0][1]


def run_layers(layers: Sequence[tuple[int, nn.Module, Optional[LayerParts]]], hidden_states_copies: Sequence[Tensor],
               copy_kwargs: Optional[Sequence[dict]] = None, *, fine_grain: int = 1, scatter_group=None,
               **layer_kwargs) -> list[Tensor]:
    """Run decoder `layers` over N copies interleaved; returns the N outputs (sequence parallel's rank layout).
    `layer_kwargs`: the HF decoder layer's kwargs shared by all copies; `copy_kwargs[c]`: copy c's own
    (position_embeddings, attention_mask, ... split along the batch). The last collective of each copy is waited
    before returning."""
    return _run_copies(layers, hidden_states_copies, copy_kwargs, fine_grain=fine_grain, scatter_group=scatter_group,
                       **layer_kwargs)[0]


# ---------------------------------------------------------------------------------------------- the stack
class InterleavedStack:
    """Runs a part's decoder layers on a micro-batch as n_copies interleaved copies, each layer's tokens in
    fine_grain chunks; called like one HF decoder layer (hidden_states, **layer kwargs)."""

    def __init__(self, layers: Sequence[tuple[int, nn.Module, Optional[LayerParts]]], n_copies: int, fine_grain: int,
                 copy_loss: str, scatter_group=None):
        self.layers, self.n_copies, self.fine_grain = list(layers), n_copies, fine_grain
        self.copy_loss, self.scatter_group = copy_loss, scatter_group
        # set for one forward of a whole causal LM by its head (_Head): the last run may stay in the chunk layout
        # (out_layout: where the last call left its output, (tp, n) or None for the rank layout), and the
        # layer-0 scatters compute the head's deferred weight grad (wgrad)
        self.stay_chunked, self.out_layout, self.wgrad = False, None, None
        first = self.layers[0][1] if self.layers else None
        self.attention_type = getattr(first, "attention_type", "full_attention")  # HF's mask lookup reads it

    def settings(self) -> dict[str, Any]:
        return {"copies": self.n_copies, "fine_grain": self.fine_grain, "copy_loss": self.copy_loss}

    def __call__(self, hidden_states: Tensor, **kwargs) -> Tensor:
        self.out_layout = None
        if kwargs.get("past_key_values") is not None:  # generation with a cache: plain HF loop
            for _, layer, _ in self.layers:
                hidden_states = layer(hidden_states, **kwargs)
            return hidden_states
        rows, n = hidden_states.shape[0], self.n_copies
        if rows % n:
            raise ValueError(f"micro_batch_interleave_num={n}: the micro-batch has {rows} rows, not divisible into "
                             f"{n} copies; feed runner_config.batch_size x micro_batch_interleave_num rows")
        copies = hidden_states.chunk(n, 0)
        split = {k: split_rows(v, rows, n) for k, v in kwargs.items()}
        copy_kwargs = [{k: v[c] for k, v in split.items()} for c in range(n)]
        outs, self.out_layout = _run_copies(self.layers, copies, copy_kwargs, fine_grain=self.fine_grain,
                                            scatter_group=self.scatter_group, stay_chunked=self.stay_chunked,
                                            wgrad=self.wgrad)
        return outs[0] if n == 1 else torch.cat(outs, 0)


class _Head:
    """The output head of a whole causal LM under SP, run as part of the interleave (its `producer` slot,
    tensor_parallel/vocab.py): the all-gather of its input is async and the head multiplies this rank's own rows
    while the other rows travel (overlap's local-first wait_linears), so the blocking gather's time is hidden
    behind half the head's GEMM. Per forward of the causal LM (a pre-hook arms it, a post-hook disarms), where the
    head is the decoder output's one reader (no hidden states returned, all logits kept):
    - a last run in the chunk layout stays there, and the gathered blocks come out in sequence order (no
      all-to-all out of the chunk layout, and no logits-size permute: overlap's `blocks`);
    - the replicated head's weight-grad GEMM is deferred to the layer-0 scatters' backward (deferred.py), when
      grads are on, the head's weight takes grads and every copy's scatter holds the box.
    Not with multi-token prediction (it reads the final norm's output and calls the head again)."""

    def __init__(self, part: nn.Module, stack: InterleavedStack):
        self.stack, self.head = stack, part.get_output_embeddings()
        self.head.producer = self.run
        self.signature = inspect.signature(part.forward)
        self.handles = (part.register_forward_pre_hook(self._arm, with_kwargs=True),
                        part.register_forward_hook(self._disarm))

    @staticmethod
    def applies(part: nn.Module) -> bool:
        from ..models.mtp import mtp_layers

        head = getattr(part, "get_output_embeddings", lambda: None)()
        return getattr(head, "gather_kind", None) is not None and not mtp_layers(part)

    def run(self, head: nn.Module, x: Tensor) -> Tensor:
        """The head's logits of x (this rank's sequence slice): gather + GEMM as the class's forward computes."""
        layout, self.stack.out_layout = self.stack.out_layout, None  # once: a later call sees the rank layout
        link = AsyncCollective(head.gather_kind, head.group, head.seq_dim, name="output_head")
        if layout is not None:
            link.blocks = layout[1]
        box = self.stack.wgrad  # made by _arm for this head's weight only
        if box is not None and box.ready:
            link.deferred = box
        return wait_linears(issue(x, link, linears=((head.weight,), (head.bias,))), link)[0]

    def _arm(self, part, args, kwargs) -> None:
        try:
            given = self.signature.bind_partial(*args, **kwargs).arguments
        except TypeError:  # the forward itself reports bad arguments
            given = {"output_hidden_states": True}
        hidden = given.get("output_hidden_states")
        hidden = getattr(part.config, "output_hidden_states", False) if hidden is None else hidden
        stack, weight = self.stack, self.head.weight
        stack.stay_chunked = not hidden and not given.get("logits_to_keep")
        # not a vocab-parallel head: its weight-grad GEMM already hides its input-grad reduce-scatter
        defer = (stack.stay_chunked and stack.scatter_group is not None and torch.is_grad_enabled()
                 and weight.requires_grad and self.head.gather_kind == "gather_replicated")
        stack.wgrad = DeferredWgrad(weight, stack.n_copies) if defer else None

    def _disarm(self, part, args, output) -> None:
        self.stack.stay_chunked, self.stack.out_layout, self.stack.wgrad = False, None, None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.head.producer = None


def check_copy_loss(copy_loss: str) -> None:
    if copy_loss not in COPY_LOSS_MODES:
        raise ValueError(f"copy_loss={copy_loss!r}: one of {COPY_LOSS_MODES} ('mean': the non-interleaved step's "
                         "gradient; 'sum': MindSpore's summed copies)")


def install(part: nn.Module, n_copies: int, fine_grain: int = 1, *, copy_loss: str = "mean") -> nn.Module:
    """Run the decoder layers of `part` (a HF causal LM or a pipeline stage) as n_copies interleaved copies, each
    layer's tokens in fine_grain chunks (installing again replaces the settings; returns part). The HF causal-LM
    API is unchanged."""
    check_copy_loss(copy_loss)
    if n_copies < 1 or fine_grain < 1:
        raise ValueError(f"micro_batch_interleave_num={n_copies} and fine_grain_interleave={fine_grain} must be >= 1")
    adapter = adapter_for(part)
    types = adapter.attention_types(part)
    if len(types) > 1:
        raise ValueError(f"micro_batch_interleave_num / fine_grain_interleave: layers of several attention types "
                         f"{sorted(types)} (sliding-window layers) are not supported; set both to 1")
    layers = [(adapter.layer_index(layer, i), layer, adapter.layer_parts(layer))
              for i, layer in adapter.layer_items(part)]
    scatter_group = None
    if layers and layers[0][0] == 0 and layers[0][2] is not None:  # the model's first layer under SP: split there
        row = layers[0][2].attn_out
        if isinstance(row, RowParallelLinear) and row.sequence_parallel:
            scatter_group = row.group
    stack = InterleavedStack(layers, n_copies, fine_grain, copy_loss, scatter_group)
    adapter.install_interleave(part, stack)
    old = getattr(part, "_msp_head", None)
    if old is not None:
        old.remove()
    part._msp_head = _Head(part, stack) if _Head.applies(part) else None
    return part


def installed(part: nn.Module) -> Optional[dict[str, Any]]:
    """{copies, fine_grain, copy_loss} of the interleave installed on `part`, or None."""
    stack = adapter_for(part).interleave_of(part)
    return None if stack is None else stack.settings()


# ---------------------------------------------------------------------------------------------- summed copies
def copy_loss_terms(token_loss_sum, logits: Tensor, targets: Tensor, labels: Tensor, n_copies: int, *,
                    shifted: bool = False) -> Tensor:
    """MindSpore's summed-copies loss of one micro-batch on this rank: sum over the copies c of (copy c's token-loss
    sum on this rank's cp shard) / (copy c's valid tokens over its whole unsharded rows). `token_loss_sum(logits,
    targets)` is the engine's token-sum loss; `labels`: the micro-batch's unsharded labels (rows split like the
    logits into n_copies; shifted=True: already shifted targets, a batch's `shift_labels`)."""
    from ..labels import IGNORE_INDEX, shift_labels

    valid = (labels if shifted else shift_labels(labels)) != IGNORE_INDEX
    counts = valid.reshape(n_copies, -1).sum(1).clamp_min(1).tolist()
    return sum(token_loss_sum(lg, tg) / cnt
               for lg, tg, cnt in zip(logits.chunk(n_copies, 0), targets.chunk(n_copies, 0), counts))
