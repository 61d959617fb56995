"""A tiny DeepSeek-V3 (built from a HF config, no download) and its single-process reference run, for the DeepSeek
parity tests (test_deepseek.py): hidden 64, 4 layers with the first dense, 8 routed experts top-2, 1 shared expert,
2 groups top-1, q_lora 32, kv_lora 16, rope 8, nope 16, v 16. The router gets larger initial weights than HF's
default so the top-k choice varies from token to token, and a non-zero e_score_correction_bias so it matters."""
from engine_cases import BETAS, EPS, LR, SEQ, VOCAB, global_batch


def deepseek_config(**overrides):
    from transformers import DeepseekV3Config

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
              n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5, norm_topk_prob=True,
              max_position_embeddings=SEQ, attention_dropout=0.0, attn_implementation="eager",
              tie_word_embeddings=False, num_nextn_predict_layers=0)
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def deepseek_model(mtp=0, **overrides):
    """The tiny model (with `mtp` multi-token-prediction layers added by msparallel_ds.models.mtp)."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    from msparallel_ds.models.mtp import add_mtp_layers

    torch.manual_seed(0)  # identical initial weights on every rank and in the reference
    model = DeepseekV3ForCausalLM(deepseek_config(**overrides))
    if mtp:
        add_mtp_layers(model, mtp)
    seed_routers(model)
    return model.float()


def seed_routers(model):
    """Router weights N(0, 0.5) from the global RNG (the top-k choice varies from token to token) and a fixed
    e_score_correction_bias ramp (so the bias matters); DeepSeek-V3 and V4 test models alike."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(-0.05, 0.05, b.numel()))


def _count_choices(model):
    """Forward hooks counting each router's top-k choices (per layer, summed over the step's forwards)."""
    import torch

    counts = {}

    def hook(router, args, out, name=None):
        counts[name] = counts.get(name, 0) + torch.bincount(out[2].reshape(-1), minlength=router.num_experts)
        return out

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(lambda m, a, o, name=name: hook(m, a, o, name))
    return counts


def update_expert_bias(model, counts, rate):
    """The references' aux-loss-free balancing after the optimizer step: each router's e_score_correction_bias moves
    by rate x sign(mean load - load) over the step's counted choices (counts: router name -> load); counts clear."""
    import torch

    with torch.no_grad():
        for name, load in counts.items():
            load = load.double()
            model.get_submodule(name).e_score_correction_bias.add_(torch.sign(load.mean() - load) * rate)
    counts.clear()


def _lm_and_mtp_losses(model, ids, labels, depth, legacy=False):
    """The LM loss and MindFormers' MTP losses written plainly, from one decoder forward: per depth k,
    [enorm(embed(ids << k)), hnorm(h)] -> eh_proj -> the MTP decoder layer -> shared_head.norm -> lm_head, token-mean
    cross-entropy against labels shifted by k + 1; h starts as the decoder output after the final norm (mcore), or
    before it with the halves swapped, [hnorm(h), enorm(embed)] (legacy)."""
    import torch
    import torch.nn.functional as F
    from transformers.masking_utils import create_causal_mask

    def ce(h, target):
        return F.cross_entropy(model.lm_head(h).flatten(0, 1), target.flatten(), ignore_index=-100)

    base = model.model
    n = model.config.num_hidden_layers
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    before_norm = []
    hook = base.norm.register_forward_hook(lambda m, args, out: before_norm.append(args[0]))
    h = base(input_ids=ids).last_hidden_state
    hook.remove()
    lm = ce(h, torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1))
    mask = create_causal_mask(config=model.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
                              position_ids=pos)
    rope = base.rotary_emb(h, pos)
    h = before_norm[0] if legacy else h
    losses = []
    for k in range(1, depth + 1):
        layer = base.layers[n + k - 1]
        shifted = torch.cat([ids[:, k:], torch.zeros_like(ids[:, :k])], 1)
        e, hn = layer.enorm(base.embed_tokens(shifted)), layer.hnorm(h)
        x = layer.eh_proj(torch.cat([hn, e] if legacy else [e, hn], -1))
        h = layer.shared_head.norm(layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope))
        losses.append(ce(h, torch.cat([labels[:, k + 1:], torch.full_like(labels[:, :k + 1], -100)], 1)))
    return lm, losses


def _seq_aux_terms(model, rows, coeff):
    """MindFormers' sequence aux loss for a sigmoid router, written per row (one row = one shard in the layouts
    tested): P = sigmoid scores normalised over the experts, f = choices / (k x tokens), coeff x E x sum_e P_e f_e,
    mean over rows and summed over MoE layers."""
    import torch

    terms = []

    def hook(router, args, out):
        logits, _, index = out
        e = logits.shape[-1]
        scores = torch.sigmoid(logits.float().view(rows, -1, e))
        probs = (scores / (scores.sum(-1, keepdim=True) + 1e-20)).mean(1)
        f = torch.stack([torch.bincount(r, minlength=e).float() / r.numel() for r in index.view(rows, -1)])
        terms.append(coeff * e * (probs * f).sum(-1).mean())
        return out

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(hook)
    return terms


def deepseek_reference(steps, rows, clip=1.0, bias_rate=None, mtp=None, aux=0.0, **overrides):
    """Single process on the whole global batch: HF loss, AdamW, clip_grad_norm_, and with `bias_rate` the
    aux-loss-free balancing update after each step (bias += rate * sign(mean load - load), loads of the whole
    global batch); `mtp` = (depth, scale[, legacy]): the MTP losses added (scale / depth x their sum); `aux`: the
    sequence aux loss coefficient (per row). Returns (LM losses, state, norms, mean MTP cross-entropies, aux losses)."""
    import torch

    model = deepseek_model(mtp=mtp[0] if mtp else 0, **overrides)
    counts = _count_choices(model) if bias_rate else {}
    terms = _seq_aux_terms(model, rows, aux) if aux else []
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    losses, norms, mtp_values, aux_values = [], [], [], []
    for step in range(steps):
        ids, labels = global_batch(step, rows)
        if mtp:
            lm, extra = _lm_and_mtp_losses(model, ids, labels, mtp[0], legacy=len(mtp) > 2 and mtp[2])
            mtp_values.append(float(sum(extra).detach()) / mtp[0])
            loss = lm + mtp[1] / mtp[0] * sum(extra)
        else:
            loss = lm = model(input_ids=ids, labels=labels).loss
        if terms:
            aux_values.append(float(sum(terms).detach()))
            loss = loss + sum(terms)
            terms.clear()
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        update_expert_bias(model, counts, bias_rate)
        losses.append(lm.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, mtp_values, aux_values
