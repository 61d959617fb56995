"""The router's load-balancing (aux) loss and z-loss with MindFormers' coefficient and scope.

MindFormers 2.1 (parallel_core/training_graph/transformer/moe/router.py `_expert_load_balancing`), per MoE layer and
micro-batch, over "shards" (the tokens one rank's router sees: its rows' sequence slice under cp / sequence parallel):

    P_e = mean over the shard's tokens of softmax(router_logits)_e        (differentiable; a sigmoid router,
          DeepSeek-V3: its sigmoid scores normalised to sum 1 over the experts, MindFormers router.py `_normalize`)
    f_e = (choices routed to e) / (top_k x the shard's tokens)            (no gradient)
    aux = coeff x E x mean over shards of sum_e P_e x f_e

and the scope (moe_router_load_balancing_type) says over which shards f is averaged first:
- "sub_sequence" (sub_seq_aux_loss, MindFormers' default; the legacy MoE): each shard its own f;
- "sequence" (seq_aux_loss): f averaged over the tp shards of the same rows and cp chunk (router.py:405 reshapes the
  dp*cp*tp shards to (dp*cp, tp) and averages over tp only; under ulysses cp a cp chunk is a contiguous sequence
  chunk, as there; a ring's zigzag chunks are this rank's two halves);
- "global_batch" (gbs_aux_loss): f averaged over every shard of the micro-batch (dp x cp x tp), then accumulated over
  the step's micro-batches (router.py:408-419: fi_accu += that mean, and the micro-batch uses fi_accu / sum(fi_accu),
  the running mean of the step's micro-batches so far; reset at step end, core/callback/callback.py:531-539 ->
  gpt_model.py:675-679). A step's forwards per router (micro-batches x interleaved copies) start a new sum, and
  the engines reset it at every step end too.
z-loss (legacy moe_config z_loss_factor, modules/transformer/moe_utils.py ZLoss; the mcore router has none):
coeff x mean over tokens of logsumexp(router_logits)^2, mean over shards.

The loss never enters the logits: like Megatron-Core's MoEAuxLossAutoScaler, the router's routing weights pass
through `AuxLossScaler`, whose backward hands the aux term a gradient of `scale` (set by the engine so the term is
averaged like the LM loss: x dp / micro-batches for the DeepSpeed engine, whose reduction divides by dp; 1 /
micro-batches for the pipeline engine). Works inside pipeline stages as well. The values of the back-propagated
forwards are recorded for logging (engine.last_aux_loss).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor, nn

from ..distributed.collectives import sum_over

if TYPE_CHECKING:
    from ..distributed.layout import ParallelLayout

__all__ = ["AuxLoss", "AuxLossScaler", "install_aux_loss", "trained_forward"]

SCOPES = ("sub_sequence", "sequence", "global_batch")


def trained_forward(router: nn.Module, output) -> bool:
    """Whether a router forward (router_logits, weights, top-k indices) is a training forward on real values: not
    eval, not under no_grad (a reentrant recompute's first pass), not shape-only (the pipeline schedule's first
    step runs on meta / empty tensors)."""
    logits = output[0]
    return router.training and torch.is_grad_enabled() and logits.numel() > 0 and not logits.is_meta


class AuxLossScaler(torch.autograd.Function):
    """Forward: `x` unchanged. Backward: x's grad passes through, `aux` gets d(loss)/d(aux) = scale, and the aux
    value is recorded in `sink` (so a forward without a backward, a shape-inference or recomputed one, is not)."""

    @staticmethod
    def forward(ctx, x: Tensor, aux: Tensor, scale: float, sink: list) -> Tensor:
        ctx.scale, ctx.value, ctx.sink = scale, aux.detach(), sink
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.sink.append(ctx.value)
        return grad, torch.full((), ctx.scale, dtype=ctx.value.dtype, device=grad.device), None, None


def _recomputing() -> bool:
    """Inside a backward: a non-reentrant checkpoint recomputing this forward (recompute.py)."""
    return torch._C._current_graph_task_id() != -1


class _WeightedSum(torch.autograd.Function):
    """sum(p * f) with the constant f kept on the node, not saved as a tensor: a recompute (non-reentrant
    checkpoint replaces saved tensors by recomputed ones) cannot swap in another f."""

    @staticmethod
    def forward(ctx, p: Tensor, f: Tensor) -> Tensor:
        ctx.f = f
        return (p * f).sum()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.f, None


@dataclass
class AuxLoss:
    """One model part's aux-loss state: the rule, the engine's gradient scale and the values of the last forwards."""

    layout: ParallelLayout
    num_experts: int
    top_k: int
    coeff: float = 0.0
    scope: str = "sub_sequence"
    z_coeff: float = 0.0
    scale: float = 1.0
    routers: int = 0  # MoE layers hooked (install_aux_loss)
    others: int = 0  # other terms recorded per forward through this state (DeepSeek-V4's indexer loss per CSA layer)
    score: str = "softmax"  # the router's score function: "softmax" | "sigmoid" | "sqrtsoftplus"
    choice: str = "routed"  # f counts "routed" (the router's top-k) | "scores" (top-k of the normalised scores:
    # MindFormers 2.1 pynative moe_utils.compute_routing_scores_for_aux_loss, also on hash-routed layers)
    per_sequence: bool = False  # P and f per sequence (row), the mean over rows (2.1 pynative _apply_seq_aux_loss)
    forwards_per_step: int = 1  # trained forwards per router and optimizer step (gbs_aux_loss's f accumulates)

    def __post_init__(self):
        if self.scope not in SCOPES:
            raise ValueError(f"aux loss scope {self.scope!r}: must be one of {', '.join(SCOPES)}")
        self.values: list[Tensor] = []  # this rank's shares of the forwards back-propagated since the last pop
        self._accu: dict[int, Tensor] = {}  # router id -> gbs_aux_loss's fi_accu of this step
        self._seen: dict[int, int] = {}  # router id -> trained forwards since the last end_step
        self._passed: Optional[set[int]] = None  # routers whose shape-inference forward was let pass (skip_inference)

    def deepspeed_scale(self, dp: int, micro_batches: int) -> None:
        """The gradient scale under a DeepSpeed engine (msp.initialize's, or accelerate's): each rank's term is its
        share of the mean over shards, DeepSpeed divides gradients by dp, micro-batches are averaged like the loss."""
        self.scale = dp / micro_batches

    @property
    def terms(self) -> int:
        """Values recorded per trained forward of the part: one per router and per other term."""
        return self.routers + self.others

    def skip_inference(self) -> None:
        """The next trained forward of each router is torch.distributed.pipelining's shape inference (a forward +
        backward before the step's micro-batches): it does not enter gbs_aux_loss's accumulated f."""
        self._passed = set()

    def end_step(self) -> None:
        """The optimizer step is over: gbs_aux_loss's accumulated f starts again at zero (MindFormers'
        reset_accu_gbs_fi)."""
        self._accu.clear()
        self._seen.clear()

    def _accumulate(self, key: int, f: Tensor) -> Tensor:
        """router.py:408-419: fi_accu += f (this micro-batch's global mean); the micro-batch uses fi_accu / sum."""
        if self._passed is not None and key not in self._passed:
            self._passed.add(key)
            if len(self._passed) >= self.routers:
                self._passed = None
            return f / f.sum()
        n = self._seen.get(key, 0)
        accu = f if n % self.forwards_per_step == 0 else self._accu[key] + f
        self._accu[key], self._seen[key] = accu, n + 1
        return accu / accu.sum()

    def _mean_over(self, t: Tensor, names: tuple[str, ...]) -> Tensor:
        n = 1
        for name in names:
            sum_over(self.layout, name, t)
            n *= self.layout.size(name)
        return t / n

    def _scores(self, logits: Tensor) -> Tensor:
        """Per-token probabilities over the experts: softmax, or the sigmoid / sqrt(softplus) scores normalised."""
        if self.score == "softmax":
            return torch.softmax(logits, dim=-1)
        scores = torch.sigmoid(logits) if self.score == "sigmoid" else torch.sqrt(nn.functional.softplus(logits))
        return scores / (scores.sum(-1, keepdim=True) + 1e-20)

    def term(self, logits: Tensor, top_k_index: Tensor, key: int = 0, rows: int = 1) -> Tensor:
        """This shard's share of the layer's aux + z loss (the shares of all shards sum to the layer's loss) for the
        router `key` (its id: gbs_aux_loss accumulates per router); `rows`: the sequences the tokens belong to (row-
        major), read with per_sequence."""
        lay = self.layout
        shards = lay.size("dp_cp") * lay.size("tp")
        total = logits.new_zeros((), dtype=torch.float32)
        logits = logits.reshape(-1, logits.shape[-1]).float()
        if self.coeff:
            rows = rows if self.per_sequence and self.scope == "sequence" else 1
            scores = self._scores(logits)
            probs = scores.view(rows, -1, scores.shape[-1]).mean(1)
            probs = probs[0] if rows == 1 else probs
            with torch.no_grad():
                if self.choice == "scores":
                    top_k_index = torch.topk(scores, self.top_k, dim=-1).indices
                index = top_k_index.reshape(rows, -1)
                row = torch.arange(rows, device=index.device)[:, None].expand_as(index)
                kept = index < self.num_experts  # a dropped choice (capacity sentinel E) counts for no expert
                f = torch.bincount((index + row * self.num_experts)[kept], minlength=rows * self.num_experts).float()
                f = f.view(rows, self.num_experts) / max(index.shape[1], 1)
                f = f[0] if rows == 1 else f
                if self.scope == "sequence":
                    f = self._mean_over(f, ("tp",))
                elif self.scope == "global_batch" and not _recomputing():
                    f = self._accumulate(key, self._mean_over(f, ("dp_cp", "tp")))
                # (recomputing: f is a placeholder, the first forward's stays on its _WeightedSum node)
            total = total + self.coeff * self.num_experts * _WeightedSum.apply(probs, f) / (shards * rows)
        if self.z_coeff:
            total = total + self.z_coeff * torch.logsumexp(logits, dim=-1).square().mean() / shards
        return total

    def hook(self, router: nn.Module, args, output):
        """Forward hook on a HF router (returns router_logits, routing weights, top-k indices)."""
        if not trained_forward(router, output):
            return output
        logits, weights, index = output
        hidden = args[0] if args else None
        rows = hidden.shape[0] if hidden is not None and hidden.dim() == 3 else 1
        term = self.term(logits, index, id(router), rows)
        return logits, AuxLossScaler.apply(weights, term, self.scale, self.values), index

    def pop_total(self, last: Optional[int] = None) -> Tensor:
        """The sum of the values recorded since the last call (this rank's shares, every layer and micro-batch that
        was back-propagated), or of the `last` ones only, then cleared. (torch.distributed.pipelining's first step
        runs a metadata-inference forward + backward on placeholder inputs before the real micro-batches: the
        pipeline engine keeps the last routers x micro-batches values.)"""
        values = self.values[-last:] if last else self.values
        total = torch.stack(values).sum() if values else torch.zeros(())
        self.values = []
        return total


def install_aux_loss(part: nn.Module, adapter, aux: AuxLoss) -> int:
    """Hook every MoE layer's router of `part`; returns how many were hooked."""
    n = 0
    for _, layer in adapter.layer_items(part):
        router = adapter.router_of(layer)
        if router is not None:
            router.register_forward_hook(aux.hook)
            n += 1
    aux.routers += n
    return n
