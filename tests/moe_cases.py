"""Tiny mixture-of-experts models (built from HF configs, no download) and their single-process reference run, for
the expert-parallel parity tests (test_moe.py). Routers get larger initial weights than HF's default (zeros in
some families) so the top-k choice varies from token to token and every expert sees traffic."""
from engine_cases import BETAS, EPS, LR, SEQ, VOCAB, global_batch, tiny_config

KINDS = ("qwen3_moe", "mixtral", "qwen2_moe")


def moe_model(kind="qwen3_moe", layers=2):
    import torch

    torch.manual_seed(0)  # identical initial weights on every rank and in the reference
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=SEQ, attention_dropout=0.0,
                  attn_implementation="eager")
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, head_dim=16,
                                                   num_experts=8, num_experts_per_tok=2, **common))
    elif kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        model = MixtralForCausalLM(MixtralConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                                 **common))
    else:  # Qwen2-MoE: a gated shared expert next to the routed ones, and a dense first layer
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32,
                                                   shared_expert_intermediate_size=48, num_experts=4,
                                                   num_experts_per_tok=2, mlp_only_layers=[0], **common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model.float()


def ep_yaml(ep=1, pp=1, moe=None, clip=0.05, **kw):
    """tiny_config with parallel_config.expert_parallel, MoE keys into model_config, and pipeline_stage (1F1B over 4
    micro-batches) when pp > 1."""
    y = tiny_config(clip=clip, **kw)
    y["parallel_config"]["expert_parallel"] = ep
    y["model"]["model_config"].update(moe or {})
    if pp > 1:
        y["parallel_config"].update(pipeline_stage=pp, micro_batch_num=4)
        y["parallel"]["pipeline_config"] = {"pipeline_interleave": False, "pipeline_scheduler": "1f1b"}
    return y


def adamw(params):
    import torch

    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def accelerate_steps(yaml, model, steps, gas=1):
    """An HF-style loop under MindFormersAccelerator (prepare, loss, backward, step) on 4 x gas rows of the global
    batch, gas micro-batches of one row per dp rank (rows d x gas + m, the engines' order) under
    accelerator.accumulate; returns (prepared model, reduced losses (the step's mean), DeepSpeed's gradient norms)."""
    from msparallel_ds.integrations.accelerate import MindFormersAccelerator

    accelerator = MindFormersAccelerator(yaml)
    model, optimizer = accelerator.prepare(model, adamw(model.parameters()))
    losses, norms = [], []
    for step in range(steps):
        ids, labels = global_batch(step, 4 * gas)
        d = accelerator.layout.rank("dp")
        total = 0.0
        for m in range(gas):
            row = slice(d * gas + m, d * gas + m + 1)
            with accelerator.accumulate(model):
                loss = model(input_ids=ids[row], labels=labels[row]).loss  # equal token counts: mean of means
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            total += accelerator.reduce_loss(loss).item() / gas
        losses.append(total)
        norms.append(float(model.get_global_grad_norm()))
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # accelerate's one state per process: the next run's own
    return model, losses, norms


def drop_by_capacity(index, weights, num_experts, factor, policy):
    """The capacity rule written plainly (loops), for one shard's tokens: per expert keep the ceil(k*T*f/E) (at most T)
    choices with the highest weight ("probs", earlier token first on ties) or the first ones in token order
    ("position"); the others get expert id E and weight 0."""
    import math

    tokens, k = index.shape
    cap = min(math.ceil(k * tokens * factor / num_experts), tokens)
    index, weights = index.clone(), weights.clone()
    for e in range(num_experts):
        slots = [(t, j) for t in range(tokens) for j in range(k) if index[t, j] == e]
        if policy == "probs":
            slots.sort(key=lambda tj: -float(weights[tj]))
        for t, j in slots[cap:]:
            index[t, j], weights[t, j] = num_experts, 0.0
    return index, weights


def _router_terms(model, rows, aux):
    """Hooks that give the MindFormers aux + z loss of every MoE layer (moe.aux_loss's formula, written per row:
    one row is one shard in the layouts tested) and, with a capacity, drop choices per row."""
    import torch

    terms = []

    def hook(router, args, out):
        logits, weights, index = out
        e = logits.shape[-1]
        per_row = logits.float().view(rows, -1, e)
        probs = torch.softmax(per_row, -1).mean(1)  # [rows, E]
        f = torch.stack([torch.bincount(index.view(rows, -1)[r], minlength=e).float() / index.view(rows, -1)[r].numel()
                         for r in range(rows)])
        if aux.get("scope") == "global_batch":
            f = f.mean(0, keepdim=True).expand_as(f)
        term = aux.get("coeff", 0.0) * e * (probs * f).sum(-1).mean()
        term = term + aux.get("z_coeff", 0.0) * torch.logsumexp(per_row, -1).square().mean()
        terms.append(term)
        return out

    for name, module in model.named_modules():
        if name.endswith("mlp.gate") and hasattr(module, "top_k"):
            module.register_forward_hook(hook)
    return terms


def _drop_per_row(model, rows, capacity):
    # HF's default grouped_mm experts path does not skip the sentinel id (only its eager loop does, or grouped_mm
    # marked expert-parallel); the engine never passes dropped choices to HF's experts, the reference uses the loop
    model.config._experts_implementation = "eager"
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            run = module.forward

            def forward(hidden, index, weights, run=run, e=module.num_experts):
                pieces = [drop_by_capacity(i, w, e, *capacity)
                          for i, w in zip(index.chunk(rows), weights.chunk(rows))]
                return run(hidden, torch_cat([p[0] for p in pieces]), torch_cat([p[1] for p in pieces]))

            module.forward = forward


def torch_cat(xs):
    import torch

    return torch.cat(xs)


def moe_reference(kind, steps, rows, clip=1.0, aux=None, capacity=None):
    """Single process on the whole global batch: HF loss (+ the routers' aux / z loss when `aux` is given), AdamW,
    clip_grad_norm_; `capacity` = (factor, policy) drops choices per row. Returns (losses, state, norms, aux values)."""
    import torch

    model = moe_model(kind)
    terms = _router_terms(model, rows, aux) if aux else []
    if capacity:
        _drop_per_row(model, rows, capacity)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    losses, norms, aux_values = [], [], []
    for step in range(steps):
        ids, labels = global_batch(step, rows)
        terms.clear()
        loss = model(input_ids=ids, labels=labels).loss
        aux_values.append(float(sum(terms)) if terms else None)
        if terms:
            loss = loss + sum(terms)
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        losses.append(loss.item() - (aux_values[-1] or 0.0))  # the LM loss (the engines log the aux apart)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, aux_values
