"""A tiny DeepSeek-V4 (HF DeepseekV4ForCausalLM from its config class, no download) and its single-process reference
run, for the DeepSeek-V4 parity tests (test_deepseek4.py): hidden 32, 4 layers (sliding, compressed sparse with a
lightning indexer, heavily compressed, sliding), 2 hyper-connection streams, 8 routed experts top-2 + 1 shared, the
first layer hash-routed. Compression rates 4 / 8 so both compressors produce entries at sequence 32. The routers get
larger weights than HF's default (so choices vary), the top-k routers a non-zero expert bias (so it matters), and the
hash router a tid2eid table of distinct experts per token (HF initialises it to zeros: every token on expert 0)."""
from deepseek_cases import seed_routers, update_expert_bias
from engine_cases import BETAS, EPS, LR, SEQ, VOCAB, global_batch

EXPERTS, TOP_K, SCALE = 8, 2, 1.5


def v4_config(**overrides):
    from transformers import DeepseekV4Config

    kw = dict(vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
              head_dim=16, q_lora_rank=16, num_experts_per_tok=TOP_K, n_routed_experts=EXPERTS, n_shared_experts=1,
              routed_scaling_factor=SCALE, hc_mult=2, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8,
              index_topk=4, sliding_window=8, num_hash_layers=1, num_nextn_predict_layers=0,
              max_position_embeddings=SEQ, attn_implementation="eager", qk_rope_head_dim=8, tie_word_embeddings=False,
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
              layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                           "sliding_attention"])
    kw.update(overrides)
    return DeepseekV4Config(**kw)


def v4_model(**overrides):
    import torch
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(0)  # identical initial weights on every rank and in the reference
    model = DeepseekV4ForCausalLM(v4_config(**overrides))
    seed_routers(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(EXPERTS, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]))
    return model.float()


def _routers(model):
    return [(n, m) for n, m in model.named_modules() if n.endswith("mlp.gate")]


class OneRank:
    """A one-process layout: every parallel size 1."""

    @staticmethod
    def size(name):
        return 1


def state_error(state, ref, bound, name=""):
    """The worst weight error of `state` against `ref` (same names and shapes): max |difference| over
    max(max |w|, 1), floored at 1 for norm weights and the zero-initialised hyper-connection biases, which would make a
    plain relative error meaningless; each tensor asserted <= bound, integer tensors equal."""
    assert set(state) == set(ref), set(state) ^ set(ref)
    worst = 0.0
    for k, want in ref.items():
        assert state[k].shape == want.shape, (name, k, state[k].shape, want.shape)
        if want.is_floating_point():
            err = float((state[k].double() - want.double()).abs().max()) / max(float(want.abs().max()), 1.0)
            worst = max(worst, err)
            assert err <= bound, (name, k, err)
        else:
            assert bool((state[k] == want).all()), (name, k)
    return worst


def v4_reference(steps, rows, clip=1.0, optimizer=None, bias_rate=None, aux=0.0, micro=None, indexer=0.0,
                 **overrides):
    """One process on the whole global batch (`micro` rows per forward, gradients summed as the global token mean:
    equal token counts): HF loss + MindFormers 2.1's pynative seq aux loss written plainly (per sequence: P = the
    sqrt(softplus) scores normalised over the experts, mean over the sequence; f = the top-k of those scores /
    (k x tokens); coeff x E x sum_e P_e f_e, mean over sequences, every MoE layer incl. the hash-routed one),
    clip_grad_norm_, the optimizer (`optimizer(model)` or AdamW), and with `bias_rate` the expert-bias update from the
    top-k routers' routed choices of the whole step; `indexer`: dsa_indexer_loss_coeff, the lightning-indexer loss of
    models/deepseek4_indexer.py (checked against MindSpore in test_deepseek4_indexer.py) added to the loss and to the
    aux values; `overrides`: v4_config's. Returns (losses, state, aux values)."""
    import torch

    from msparallel_ds.models import adapter_for
    from msparallel_ds.models.deepseek4_indexer import install_indexer_loss

    model = v4_model(**overrides)
    micro = micro or rows
    kl = install_indexer_loss(model, adapter_for(model), OneRank(), indexer, None) if indexer else None
    if kl is not None:
        kl.scale = micro / rows  # d(loss)/d(term), as the micro-batch's LM loss below
    terms, counts = [], {}

    def hook(router, args, out, name):
        logits, _, index = out
        if aux:
            b = args[0].shape[0]
            s = torch.sqrt(torch.nn.functional.softplus(logits.float()))
            s = (s / (s.sum(-1, keepdim=True) + 1e-20)).view(b, -1, EXPERTS)
            top = torch.topk(s, TOP_K, dim=-1).indices
            f = torch.stack([torch.bincount(t.reshape(-1), minlength=EXPERTS).float() / t.numel() for t in top])
            terms.append(aux * EXPERTS * (s.mean(1) * f).sum(-1).mean())
        if bias_rate and not hasattr(router, "tid2eid"):
            counts[name] = counts.get(name, 0) + torch.bincount(index.reshape(-1), minlength=EXPERTS)
        return out

    for name, router in _routers(model):
        router.register_forward_hook(lambda m, a, o, name=name: hook(m, a, o, name))
    opt = optimizer(model) if optimizer else torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                                                 weight_decay=0.0)
    losses, aux_values = [], []
    for step in range(steps):
        ids, labels = global_batch(step, rows)
        opt.zero_grad()
        total, total_aux = 0.0, 0.0
        for lo in range(0, rows, micro):
            loss = model(input_ids=ids[lo:lo + micro], labels=labels[lo:lo + micro]).loss
            extra = sum(terms) if terms else 0.0
            terms.clear()
            ((loss + extra) * (micro / rows)).backward()
            total += loss.item() * micro / rows
            total_aux += float(extra) * micro / rows
            if kl is not None:
                total_aux += float(kl.pop_total()) * micro / rows
        for p in model.parameters():  # unused this step (the indexer without its loss; a compressor with no
            if p.grad is None:         # entry): a zero gradient, as MindSpore gives every trainable parameter,
                p.grad = torch.zeros_like(p)  # so weight decay still applies (DeepSpeed fills them so too)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        opt.step()
        update_expert_bias(model, counts, bias_rate)
        losses.append(total)
        aux_values.append(total_aux)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, aux_values
