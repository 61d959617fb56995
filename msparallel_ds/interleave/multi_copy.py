"""micro_batch_interleave_num = N: the micro-batch's rows run as N copies through the decoder, layer by layer, so
one copy's tensor/sequence-parallel collective is in flight while another copy computes.

The schedule is written once, for any N: every copy is a generator (`copy_steps`) that runs the decoder layers as
steps (fine_grain.layer_steps) and yields right after it has started a collective (comm.issue, async_op=True);
`round_robin` resumes the copies in turn, and a copy waits for its collective only when it resumes and needs the
result. With N = 2 and SP, per layer and copy: [norm, all-gather] [wait, QKV, attention, out-proj, reduce-scatter]
[wait, residual, norm, all-gather] [wait, FFN, reduce-scatter], copy 1's bracket between copy 0's issue and wait.

Backward needs no scheduler: eager autograd runs ready nodes in reverse creation order, so the interleaved forward
gives an interleaved backward. Each wait node's backward starts the transposed collective (reduce-scatter of the
input grad, all-gather of the output grad) and the matching issue node's backward, created before the other
copies' nodes, waits for it after their backward ran; the QKV and gate/up GEMMs' backward (comm.wait_linears)
starts the input-grad collective before computing the weight grads.

What overlaps, honestly:
- tp with SP: the 2 all-gathers and 2 reduce-scatters per layer, forward and backward; tp without SP: the 2
  all-reduces per layer forward, the 2 input-grad all-reduces backward.
- cp: ring attention already overlaps its own K/V transfers with its block computations; here a copy's ring runs
  while other copies' tp collectives are in flight (the ring's transfers are not split into scheduler steps, so
  they do not overlap another copy's compute). cp-only layers (tp = 1) run whole, one copy after the other.
- dp: DeepSpeed's gradient reduction after backward is unchanged (it sees one backward of the whole micro-batch).
- Not interleaved: embedding, final norm, lm_head and loss run once on the whole micro-batch (the vocab-parallel
  embedding's all-reduce and the lm_head's gather are blocking); recomputed layers, the weight-grad all-reduces of
  replicated kv / SP norm / SP bias parameters (small, blocking, after all copies contributed).

Semantics: the copies are rows of one micro-batch and the engine's loss is the token sum over all of them divided
by the global token count, so the step's gradient equals the non-interleaved step's (a speed feature). MindSpore's
MicroBatchInterleaved instead SUMS the copies' losses (each copy's token mean), which scales gradients by about N;
`copy_loss="sum"` (msp.parallelize(model, layout, copy_loss="sum") before msp.initialize) reproduces it: each
micro-batch's loss is sum_c mean_c (copy c's token mean over its rows on this dp rank, all cp shards), averaged
over dp ranks and micro-batches, and the reported loss is divided by N as MindFormers logs it.

Hook: `install(model, n_copies, fine_grain)` wraps the HF base model's forward; while it runs, `base.layers` is a
one-entry list holding the interleaved stack, so HF still builds the embedding, position ids, RoPE and masks once
for the whole micro-batch and the stack splits them per copy (dim 0). Pipeline stages call `run_layers` on their
own layers.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from ..tensor_parallel.comm import current_copy
from .fine_grain import join_chunks, layer_steps, resolve, scatter_input, split_chunks

__all__ = ["round_robin", "run", "run_layers", "install", "copy_loss_terms", "COPY_LOSS_MODES"]

COPY_LOSS_MODES = ("mean", "sum")


# ---------------------------------------------------------------------------------------------- the scheduler
def round_robin(gens: Sequence, ids: Optional[Sequence] = None):
    """Generator: step each live generator in turn (one step = up to its next yield, under current_copy(id)),
    yielding after every step; returns their return values. Nests: a copy's layer runs its chunks with it."""
    ids = list(range(len(gens))) if ids is None else list(ids)
    results: list = [None] * len(gens)
    live = list(range(len(gens)))
    while live:
        for i in list(live):
            with current_copy(ids[i]):
                try:
                    next(gens[i])
                except StopIteration as stop:
                    results[i] = stop.value
                    live.remove(i)
                    continue
            yield
    return results


def run(gen) -> Any:
    """Drive a generator to its end; its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def copy_steps(layers: Sequence[nn.Module], h: Tensor, kw: dict, *, copy: int = 0, fine_grain: int = 1):
    """Generator: one copy through `layers` (yields after each collective it starts); returns its hidden state."""
    hs = split_chunks(scatter_input(layers[0], h), fine_grain) if len(layers) else [h]
    for i, layer in enumerate(layers):
        index = getattr(getattr(layer, "self_attn", None), "layer_idx", i)
        hs = yield from layer_steps(layer, hs, kw, index=index, copy=copy)
    return join_chunks([resolve(h) for h in hs])


def run_layers(layers: Sequence[nn.Module], hidden_states_copies: Sequence[Tensor],
               copy_kwargs: Optional[Sequence[dict]] = None, *, fine_grain: int = 1, **layer_kwargs) -> list[Tensor]:
    """Run decoder `layers` over N copies interleaved; returns the N outputs. `layer_kwargs`: the HF decoder layer's
    kwargs shared by all copies; `copy_kwargs[c]`: copy c's own (position_embeddings, attention_mask, ... split
    along the batch). For pipeline stages: hidden states arrive as the stage's input (already SP-sharded unless
    the stage holds layer 0). The last collective of each copy is waited before returning."""
    n = len(hidden_states_copies)
    kws = [{**layer_kwargs, **(copy_kwargs[c] if copy_kwargs else {})} for c in range(n)]
    gens = [copy_steps(layers, hidden_states_copies[c], kws[c], copy=c, fine_grain=fine_grain) for c in range(n)]
    return run(round_robin(gens))


# ---------------------------------------------------------------------------------------------- HF hook
def _split_rows(value: Any, rows: int, n: int) -> list:
    """value split into n along dim 0 if it is per-row (dim 0 == rows), else n references to it."""
    if torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == rows:
        return list(value.chunk(n, 0))
    if isinstance(value, tuple) and value and all(torch.is_tensor(v) for v in value):
        parts = [_split_rows(v, rows, n) for v in value]
        return [tuple(p[c] for p in parts) for c in range(n)]
    return [value] * n


class InterleavedStack(nn.Module):
    """Stands in for base.layers during a forward: splits the micro-batch into copies, runs run_layers."""

    def __init__(self, layers: nn.ModuleList, n_copies: int, fine_grain: int):
        super().__init__()
        object.__setattr__(self, "_layers", layers)  # not a submodule: names and parameters stay the model's
        self.n_copies, self.fine_grain = n_copies, fine_grain
        first = layers[0] if len(layers) else None
        self.attention_type = getattr(first, "attention_type", "full_attention")

    def forward(self, hidden_states: Tensor, **kwargs) -> Tensor:
        layers = list(self._layers)
        if kwargs.get("past_key_values") is not None:  # generation with a cache: plain HF loop
            for layer in layers:
                hidden_states = layer(hidden_states, **kwargs)
            return hidden_states
        rows, n = hidden_states.shape[0], self.n_copies
        if rows % n:
            raise ValueError(f"micro_batch_interleave_num={n}: the micro-batch has {rows} rows, not divisible into "
                             f"{n} copies; feed runner_config.batch_size x micro_batch_interleave_num rows")
        copies = hidden_states.chunk(n, 0)
        split = {k: _split_rows(v, rows, n) for k, v in kwargs.items()}
        copy_kwargs = [{k: v[c] for k, v in split.items()} for c in range(n)]
        outs = run_layers(layers, copies, copy_kwargs, fine_grain=self.fine_grain)
        return outs[0] if n == 1 else torch.cat(outs, 0)


def install(model: nn.Module, n_copies: int, fine_grain: int = 1, *, copy_loss: str = "mean") -> nn.Module:
    """Run `model`'s decoder layers as n_copies interleaved copies, each layer's tokens in fine_grain chunks
    (idempotent per model; returns it). The HF causal-LM API is unchanged."""
    if copy_loss not in COPY_LOSS_MODES:
        raise ValueError(f"copy_loss={copy_loss!r}: one of {COPY_LOSS_MODES} ('mean': the non-interleaved step's "
                         "gradient; 'sum': MindSpore's summed copies)")
    if n_copies < 1 or fine_grain < 1:
        raise ValueError(f"micro_batch_interleave_num={n_copies} and fine_grain_interleave={fine_grain} must be >= 1")
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"micro_batch_interleave_num / fine_grain_interleave: {type(model).__name__} has no "
                         "decoder ModuleList at <base>.layers (Llama/Qwen2/Mistral/Qwen3 family)")
    types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if len(types) > 1:
        raise ValueError(f"micro_batch_interleave_num / fine_grain_interleave: layers of several attention types "
                         f"{sorted(types)} (sliding-window layers) are not supported; set both to 1")
    model.msp_interleave = {"copies": n_copies, "fine_grain": fine_grain, "copy_loss": copy_loss}
    if getattr(base, "_msp_interleave_stack", None) is not None:
        stack = base._msp_interleave_stack
        stack.n_copies, stack.fine_grain = n_copies, fine_grain
        return model
    stack = InterleavedStack(layers, n_copies, fine_grain)
    object.__setattr__(base, "_msp_interleave_stack", stack)
    swapped = nn.ModuleList([stack])
    inner = base.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        real = base._modules["layers"]
        base._modules["layers"] = swapped
        try:
            return inner(*args, **kwargs)
        finally:
            base._modules["layers"] = real

    base.forward = forward
    return model


# ---------------------------------------------------------------------------------------------- summed copies
def copy_loss_terms(token_loss_sum, logits: Tensor, targets: Tensor, labels: Tensor, n_copies: int) -> Tensor:
    """MindSpore's summed-copies loss of one micro-batch on this rank: sum over the copies c of (copy c's token-loss
    sum on this rank's cp shard) / (copy c's valid tokens over its whole unsharded rows). `token_loss_sum(logits,
    targets)` is the engine's token-sum loss; `labels`: the micro-batch's unsharded labels (rows split like the
    logits into n_copies)."""
    from ..context_parallel.batch import shift_labels

    counts = (shift_labels(labels) != -100).reshape(n_copies, -1).sum(1).clamp_min(1).tolist()
    return sum(token_loss_sum(lg, tg) / cnt
               for lg, tg, cnt in zip(logits.chunk(n_copies, 0), targets.chunk(n_copies, 0), counts))
