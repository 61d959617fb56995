"""Tiny HF models built from a config (no hub download), shared by the tests."""


def tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # every rank and the reference build identical weights
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      attention_dropout=0.0, attn_implementation="eager")
    return LlamaForCausalLM(cfg).float()
