"""Tiny mixture-of-experts models (built from HF configs, no download) and their single-process reference run, for
the expert-parallel parity tests (test_moe.py). Routers get larger initial weights than HF's default (zeros in
some families) so the top-k choice varies from token to token and every expert sees traffic."""
from engine_cases import BETAS, EPS, LR, SEQ, VOCAB, global_batch

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


def moe_reference(kind, steps, rows, clip=1.0):
    """Single process on the whole global batch: HF loss, AdamW, clip_grad_norm_. Returns (losses, state, norms)."""
    import torch

    model = moe_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    losses, norms = [], []
    for step in range(steps):
        ids, labels = global_batch(step, rows)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms
