"""Multi-token prediction (DeepSeek-V3; MindFormers mtp_depth / num_nextn_predict_layers / mtp_num_layers with
mtp_loss_scaling_factor), trained as MindFormers 2.x (mcore multi_token_prediction.py) trains it.

Depth k = 1..D has one MTP layer: the model's decoder layer type (MLA + MoE for DeepSeek-V3) plus `enorm`, `hnorm`,
`eh_proj` (2h -> h, no bias) and `shared_head.norm`; the embedding and the output head are the main model's:

    h_0 = the decoder's output (mcore: after the final norm; legacy: before it)
    h_k = shared_head.norm(layer_k(eh_proj([enorm(embed(ids << k)), hnorm(h_{k-1})])))   (legacy: [hnorm, enorm])
    loss_k = token-mean cross-entropy of head(h_k) against the labels shifted by k + 1 (the rolled-in tail ignored)
    mtp loss = mtp_loss_scaling_factor / D * sum_k loss_k, added to the LM loss and logged apart

`ids << k` is input_ids shifted left by k with id 0 rolled in (MindFormers' roll_tensor). RoPE positions and the
attention mask are the main model's. The MTP layers are appended to the base model's `layers` as layers N..N+D-1
(N = num_hidden_layers), which HF's decoder loop (`layers[:num_hidden_layers]`) skips, so their parameter names
are HF DeepSeek-V3's own (`model.layers.{N}.enorm.weight`, `model.layers.{N}.self_attn.q_a_proj.weight`, ...), what
MindFormers' converters map its MTP layer to; tensor, sequence, context and expert parallel reach them through
the same plan patterns as the decoder layers. The engine feeds the shifted ids (cut like input_ids, so context
parallel shards them as it shards the sequence) and computes the losses from `outputs`.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

__all__ = ["MultiTokenPrediction", "StageMTP", "add_mtp_layers", "mtp_inputs", "mtp_layers", "run_depths",
           "shift_left"]

MTP_SEED = 20251  # MTP layers a model lacks are initialised from this seed: the same weights on every rank


def shift_left(x: Tensor, k: int, fill: int) -> Tensor:
    """x [b, s] shifted left by k along the sequence, `fill` rolled in at the tail."""
    return torch.cat([x[:, k:], x.new_full((x.shape[0], min(k, x.shape[1])), fill)], dim=1)


def mtp_layers(model: nn.Module) -> list[nn.Module]:
    """The MTP layers the base model holds after its num_hidden_layers decoder layers."""
    base = model.get_submodule(model.base_model_prefix)
    return list(base.layers)[model.config.num_hidden_layers:]


def add_mtp_layers(model: nn.Module, depth: int, make_layer=None) -> list[nn.Module]:
    """Give a HF causal LM `depth` MTP layers (kept when it has them already; seeded init otherwise, on the model's
    device, meta included); sets config.num_nextn_predict_layers. Returns the MTP layers. `make_layer(model, k)`: a
    family's own MTP layer k (its adapter's make_mtp_layer: DeepSeek-V4); default the one described above."""
    base = model.get_submodule(model.base_model_prefix)
    config, have = model.config, mtp_layers(model)
    if len(have) > depth:
        raise ValueError(f"the model holds {len(have)} MTP layers but the YAML asks for mtp_depth={depth}")
    decoder = type(base.layers[config.num_hidden_layers - 1])
    norm = type(base.norm)
    h = config.hidden_size
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[]), torch.device(device):
        for k in range(len(have), depth):
            torch.manual_seed(MTP_SEED + k)
            if make_layer is not None:
                layer = make_layer(model, k)
            else:
                layer = decoder(config, config.num_hidden_layers + k)
                layer.enorm, layer.hnorm = norm(h, eps=config.rms_norm_eps), norm(h, eps=config.rms_norm_eps)
                layer.eh_proj = nn.Linear(2 * h, h, bias=False)
                layer.shared_head = nn.Module()
                layer.shared_head.norm = norm(h, eps=config.rms_norm_eps)
            if device.type != "meta":
                layer.apply(model._init_weights)
            base.layers.append(layer)
    config.num_nextn_predict_layers = depth
    return mtp_layers(model)


def run_depths(layers, embed: nn.Module, h: Tensor, ids: list[Tensor], ctx: dict, *, hidden_first: bool,
               scatter=None) -> list[Tensor]:
    """h_1 .. h_D from the decoder's output h and depth k's shifted ids (module docstring); `ctx`: the decoder
    layers' keyword arguments (position embeddings, mask, ...). A family's own MTP layers run their own block
    (`run_depths` on the layer class: DeepSeek-V4's, models.deepseek4_mtp)."""
    own = getattr(layers[0], "run_depths", None) if len(layers) else None
    if own is not None:
        return own(layers, embed, h, ids, ctx)
    outs = []
    for layer, ids_k in zip(layers, ids):
        e = embed(ids_k)
        if scatter is not None:
            e = scatter(e)
        parts = [layer.hnorm(h), layer.enorm(e)] if hidden_first else [layer.enorm(e), layer.hnorm(h)]
        x = layer.eh_proj(torch.cat(parts, dim=-1))
        x = layer(x, use_cache=False, past_key_values=None, **ctx)
        h = layer.shared_head.norm(x[0] if isinstance(x, tuple) else x)
        outs.append(h)
    return outs


def mtp_inputs(ids: Tensor, labels: Tensor, layout, depth: int) -> tuple[list[Tensor], list[Tensor]]:
    """Depth k's shifted input ids and targets (labels shifted by k + 1, the rolled-in tail ignored), k = 1..depth,
    cut like input_ids and the LM targets (context parallel shards them as it shards the sequence)."""
    from ..context_parallel.batch import inputs_and_targets
    from ..labels import IGNORE_INDEX

    out_ids, targets = [], []
    for k in range(1, depth + 1):
        inputs, t = inputs_and_targets({"input_ids": shift_left(ids, k, 0),
                                        "labels": shift_left(labels, k, IGNORE_INDEX)}, layout)
        out_ids.append(inputs["input_ids"])
        targets.append(t)
    return out_ids, targets


class StageMTP:
    """The MTP layers of a pipeline's last stage (models.stage.StageModule.forward runs them after the final norm;
    legacy: on the hidden state before it)."""

    def __init__(self, layers: list[nn.Module], scale: float, *, after_norm: bool = True, hidden_first: bool = False,
                 scatter=None):
        self.layers, self.scale = layers, float(scale)
        self.after_norm, self.hidden_first, self.scatter = after_norm, hidden_first, scatter

    @property
    def depth(self) -> int:
        return len(self.layers)

    def run(self, normed: Tensor, hidden: Tensor, embed: nn.Module, ids: list[Tensor], ctx: dict) -> list[Tensor]:
        return run_depths(self.layers, embed, normed if self.after_norm else hidden, ids, ctx,
                          hidden_first=self.hidden_first, scatter=self.scatter)


class MultiTokenPrediction:
    """The MTP layers of a whole model, run after its decoder (a forward hook on the base model) on the context the
    decoder layers got (position embeddings, mask, attention kwargs), from ids the engine sets in `pending_ids`."""

    def __init__(self, model: nn.Module, scale: float, *, after_norm: bool = True, hidden_first: bool = False,
                 scatter=None):
        self.model, self.scale = model, float(scale)
        self.layers = mtp_layers(model)
        self.after_norm, self.hidden_first = after_norm, hidden_first
        self.scatter = scatter  # sequence parallel: cuts the embedding output to this rank's slice
        self.pending_ids: list[Tensor] = []  # depth k's shifted input ids for the next forward (this rank's shard)
        self.outputs: list[Tensor] = []      # depth k's hidden states of the last forward
        base = model.get_submodule(model.base_model_prefix)
        self._ctx: dict = {}
        self._h: Optional[Tensor] = None
        base.layers[0].register_forward_pre_hook(self._capture_context, with_kwargs=True)
        base.norm.register_forward_hook(self._capture_hidden)
        base.register_forward_hook(self._run)

    @property
    def depth(self) -> int:
        return len(self.layers)

    def _capture_context(self, module, args, kwargs):
        self._ctx = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "past_key_values", "use_cache")}

    def _capture_hidden(self, module, args, output):
        self._h = output if self.after_norm else args[0]

    def _run(self, module, args, output):
        if not self.pending_ids:  # a forward the engine did not prepare (e.g. evaluation): no MTP
            self.outputs = []
            return output
        ids, self.pending_ids = self.pending_ids, []
        outs = run_depths(self.layers, self.model.get_input_embeddings(), self._h, ids, self._ctx,
                          hidden_first=self.hidden_first, scatter=self.scatter)
        self.outputs, self._h, self._ctx = outs, None, {}
        return output

    # ------------------------------------------------------------------------------------------ the engine's side
    def shifted_labels(self, labels: Tensor) -> list[Tensor]:
        """Depth k's labels: shifted left by k, the rolled-in tail ignored (the LM's shift then adds one more)."""
        from ..labels import IGNORE_INDEX

        return [shift_left(labels, k, IGNORE_INDEX) for k in range(1, self.depth + 1)]

    def prepare(self, micro: dict, layout) -> list[Tensor]:
        """Before a micro-batch's forward: queue depth k's shifted ids (this rank's cut of them) and return depth k's
        targets (labels shifted by k + 1, tail ignored), cut like the LM targets."""
        ids = micro["input_ids"]
        self.pending_ids, targets = mtp_inputs(ids, micro.get("labels", ids), layout, self.depth)
        return targets

    def loss_sums(self, head: nn.Module, targets: list[Tensor]) -> list[Tensor]:
        """Each depth's summed token cross-entropy over this rank's tokens, from the last forward's outputs."""
        from ..loss import token_loss_sum

        if len(self.outputs) != self.depth:
            raise RuntimeError("multi-token prediction: the forward ran without the MTP inputs (prepare() first)")
        return [token_loss_sum(head(h), t, head) for h, t in zip(self.outputs, targets)]
