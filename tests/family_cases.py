"""Tiny models of the GLM and GPT-2 families and their single-process reference runs (tests/test_families.py).

The YAML is engine_cases.tiny_config / test_pipeline.pp_config's (hidden 64, 4 layers, 4 heads, 2 kv heads);
each family's tiny HF model matches it, so one MindFormers config drives every family.
"""
from engine_cases import BETAS, LR, SEQ, VOCAB, global_batch

# Adam's eps: 1e-6, not engine_cases' 1e-8. With 1e-8 an element whose gradient is ~1e-8 moves by ~lr whatever
# its size, so a last-bit difference of a tp sum there shows as a 3e-5 weight difference after 3 steps (seen on
# down_proj); 1e-6 keeps the weights' parity at 1e-5 while such elements stay sensitive to real errors.
EPS = 1e-6


def tiny_family(name, tied=False):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)  # identical initial weights on every rank and in the reference
    common = dict(vocab_size=VOCAB, num_hidden_layers=4, attn_implementation="eager", pad_token_id=0, eos_token_id=1)
    if name in ("glm", "glm4"):
        cfg = AutoConfig.for_model(name, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
                                   attention_bias=True, max_position_embeddings=SEQ, attention_dropout=0.0,
                                   tie_word_embeddings=False, **common)
    elif name == "gpt2":
        cfg = AutoConfig.for_model("gpt2", n_embd=64, n_head=4, n_layer=4, n_positions=SEQ, vocab_size=VOCAB,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1,
                                   attn_implementation="eager", tie_word_embeddings=tied)
    elif name == "glm4_moe":  # DeepSeek-V3's MoE block: 8 experts top-2 in 2 groups top-1, 1 shared, 1st layer dense
        cfg = AutoConfig.for_model(name, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
                                   n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
                                   topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                   norm_topk_prob=True, max_position_embeddings=SEQ, attention_dropout=0.0,
                                   tie_word_embeddings=False, **common)
    else:
        raise ValueError(name)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # HF zero-inits biases and routers: random ones, so a wrong split or routing shows
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0, 0.02)
            if n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(-0.05, 0.05, b.numel()))
    return model


def reference_run(name, steps, rows, *, clip=1.0, tied=False):
    """Single process (AdamW with EPS): HF loss, AdamW, clip_grad_norm_. Returns per-step losses and the final state dict."""
    import torch

    model = tiny_family(name, tied)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    losses = []
    for step in range(steps):
        ids, labels = global_batch(step, rows)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
