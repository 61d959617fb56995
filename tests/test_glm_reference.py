"""ChatGLM2/3 (MindFormers ChatGLM2ForConditionalGeneration) is HF's `glm` architecture: a forward written line by
line in torch from mindformers 1.3.2 models/glm2 (glm2.py ChatGLM2Model, glm2_modules.py FreqsMgr / RMSNorm /
SwiGLU / MLP, glm2_transformer.py ChatGLM2SelfAttention / CoreAttention / ChatGLM2Block, training path: no
use_past, no flash attention) on MindFormers-named weights equals GlmForCausalLM on the weights our weight map
converts, with the config chatglm_hf_config maps from the same ChatGLM2Config keys. Also: the map is exact both
ways, and the keys HF glm cannot express are refused naming the key.
"""
import math

import numpy as np
import pytest
import torch

from msparallel_ds.checkpoint.weight_map import to_hf, to_mf
from msparallel_ds.models.glm import GlmFamily, chatglm_hf_config

MC = {"type": "ChatGLM2Config", "num_layers": 2, "padded_vocab_size": 96, "hidden_size": 64, "ffn_hidden_size": 80,
      "kv_channels": 16, "num_attention_heads": 4, "seq_length": 24, "layernorm_epsilon": 1e-5, "rope_ratio": 2,
      "rmsnorm": True, "apply_residual_connection_post_layernorm": False, "post_layer_norm": True,
      "add_bias_linear": False, "add_qkv_bias": True, "multi_query_attention": True, "multi_query_group_num": 2,
      "apply_query_key_layer_scaling": True}


def _mf_weights(mc, seed=0):
    """Random weights under MindFormers' ChatGLM2 names (transformer.encoder.layers.N...)."""
    g = torch.Generator().manual_seed(seed)
    h, d, n, kv, f = mc["hidden_size"], mc["kv_channels"], mc["num_attention_heads"], mc["multi_query_group_num"], \
        mc["ffn_hidden_size"]
    qkv = (n + 2 * kv) * d

    def r(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    w = {"transformer.embedding.embedding_weight": r(mc["padded_vocab_size"], h, scale=1.0),
         "transformer.encoder.final_layernorm.weight": 1 + r(h, scale=0.1),
         "transformer.output_layer.weight": r(mc["padded_vocab_size"], h)}
    for i in range(mc["num_layers"]):
        p = f"transformer.encoder.layers.{i}."
        w.update({p + "input_layernorm.weight": 1 + r(h, scale=0.1),
                  p + "self_attention.query_key_value.weight": r(qkv, h),
                  p + "self_attention.query_key_value.bias": r(qkv, scale=0.3),
                  p + "self_attention.dense.weight": r(h, n * d),
                  p + "post_attention_layernorm.weight": 1 + r(h, scale=0.1),
                  p + "mlp.dense_h_to_4h.weight": r(2 * f, h),
                  p + "mlp.dense_4h_to_h.weight": r(h, f)})
    return w


def chatglm2_forward(w, mc, input_ids):
    """mindformers 1.3.2 models/glm2, training forward (float32), in torch."""
    bs, seq_len = input_ids.shape
    h, d, n_head = mc["hidden_size"], mc["kv_channels"], mc["num_attention_heads"]
    n_kv, eps = mc["multi_query_group_num"], mc["layernorm_epsilon"]
    # FreqsMgr(dim=rotary_dim // 2, base=10000, rope_ratio): its `cache` is what apply_rotary_pos_emb reads
    dim = d // 2
    base = 10000 * mc["rope_ratio"]
    theta = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    idx_theta = np.outer(np.arange(seq_len, dtype=np.float32), theta).astype(np.float32)
    rope_cache = torch.from_numpy(np.stack((np.cos(idx_theta), np.sin(idx_theta)), axis=-1))
    # get_masks: low triangle < 0.5 -> True where masked
    attention_mask = (torch.tril(torch.ones(1, seq_len, seq_len)).repeat(bs, 1, 1) < 0.5).reshape(bs, 1, -1, seq_len)

    def rms(x, weight):  # ChatGLM2RMSNorm._self_norm
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight

    def rotary(x):  # ChatGLM2SelfAttention.apply_rotary_pos_emb
        b, nh, sq, _ = x.shape
        rot_dim = rope_cache.shape[-2] * 2
        x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
        xshaped = x.reshape(b, nh, sq, rot_dim // 2, 2)
        cache = rope_cache.reshape(-1, 1, sq, xshaped.shape[3], 2)
        x0, x1 = xshaped[..., :1], xshaped[..., 1:]
        c0, c1 = cache[..., :1], cache[..., 1:]
        out = torch.stack((x0 * c0 - x1 * c1, x1 * c0 + x0 * c1), -1).reshape(b, nh, sq, -1)
        return torch.cat((out, x_pass), -1)

    def repeat_kv(x, rep):  # _repeat_kv: reshape to (bs, n_kv, 1, s*d), tile rep, reshape
        b, nk, s, hd = x.shape
        return x.reshape(b, nk, 1, s * hd).tile(1, 1, rep, 1).reshape(b, nk * rep, s, hd)

    def core_attention(q, k, v):  # CoreAttention.construct, apply_query_key_layer_scaling
        q = q / math.sqrt(d)
        scores = q @ k.transpose(-1, -2)
        scores = scores + attention_mask.float() * -10000
        probs = torch.softmax(scores.float(), -1)
        ctx = probs @ v
        return ctx.permute(0, 2, 1, 3).reshape(bs, seq_len, -1)  # _merge_heads

    x = torch.nn.functional.embedding(input_ids, w["transformer.embedding.embedding_weight"])
    for i in range(mc["num_layers"]):
        p = f"transformer.encoder.layers.{i}."
        ln = rms(x, w[p + "input_layernorm.weight"])
        mixed = torch.nn.functional.linear(ln, w[p + "self_attention.query_key_value.weight"],
                                           w[p + "self_attention.query_key_value.bias"])
        q, k, v = mixed.split([n_head * d, n_kv * d, n_kv * d], -1)
        q = q.reshape(bs, seq_len, n_head, d).permute(0, 2, 1, 3)
        k = k.reshape(bs, seq_len, n_kv, d).permute(0, 2, 1, 3)
        v = v.reshape(bs, seq_len, n_kv, d).permute(0, 2, 1, 3)
        q, k = rotary(q), rotary(k)
        rep = n_head // n_kv
        ctx = core_attention(q, repeat_kv(k, rep), repeat_kv(v, rep))
        attn = torch.nn.functional.linear(ctx, w[p + "self_attention.dense.weight"])
        x = x + attn  # residual = hidden_states (apply_residual_connection_post_layernorm False), dropout 0
        ln = rms(x, w[p + "post_attention_layernorm.weight"])
        inter = torch.nn.functional.linear(ln, w[p + "mlp.dense_h_to_4h.weight"])
        x0, x1 = inter.chunk(2, -1)  # ChatGLM2SwiGLU: split, silu(x0) * x1
        x = x + torch.nn.functional.linear(x0 * torch.sigmoid(x0) * x1, w[p + "mlp.dense_4h_to_h.weight"])
    x = rms(x, w["transformer.encoder.final_layernorm.weight"])
    return torch.nn.functional.linear(x, w["transformer.output_layer.weight"])


def _hf_model(mc):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kw = chatglm_hf_config(mc)
    cfg = AutoConfig.for_model(model_type, **kw, attn_implementation="eager")
    return AutoModelForCausalLM.from_config(cfg).float().eval()


def test_chatglm2_is_hf_glm():
    model = _hf_model(MC)
    mf = _mf_weights(MC)
    ops = GlmFamily().mindformers_weights(model.config, legacy=True)
    hf = to_hf(ops, mf, model.config)
    missing, unexpected = model.load_state_dict(hf, strict=False)
    assert not unexpected and all(k.endswith("inv_freq") for k in missing), (missing, unexpected)
    ids = torch.randint(0, MC["padded_vocab_size"], (2, MC["seq_length"]), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = chatglm2_forward(mf, MC, ids)
        ours = model(input_ids=ids).logits
    diff = (ref - ours).abs().max().item()
    print(f"ChatGLM2 reference vs HF GlmForCausalLM: max |logits diff| = {diff:.3e} (|logits| ~ {ref.abs().max():.2f})")
    assert diff <= 1e-4, diff
    # the reference can fail: HF's own half-rotation (Llama's rotate_half) on the same weights differs a lot
    from transformers.models.llama import modeling_llama

    glm_mod = __import__("transformers.models.glm.modeling_glm", fromlist=["rotate_half"])
    orig = glm_mod.rotate_half
    glm_mod.rotate_half = modeling_llama.rotate_half
    try:
        with torch.no_grad():
            other = model(input_ids=ids).logits
    finally:
        glm_mod.rotate_half = orig
    assert (ref - other).abs().max().item() > 1e-2


def test_chatglm_weight_map_is_exact_both_ways():
    model = _hf_model(MC)
    ops = GlmFamily().mindformers_weights(model.config, legacy=True)
    mf = _mf_weights(MC, seed=3)
    hf = to_hf(ops, mf, model.config)
    back = to_mf(ops, hf, model.config, fused=True)
    assert set(back) == set(mf) and all(torch.equal(back[k], mf[k]) for k in mf)
    split = to_mf(ops, hf, model.config, fused=False)  # 2.1.0 qkv_concat / mlp_concat false: wq/wk/wv, left/right
    assert "transformer.encoder.layers.0.self_attention.wq.bias" in split
    assert "transformer.encoder.layers.0.mlp.dense_h_to_4h.weight" in split
    again = to_hf(ops, split, model.config)
    assert set(again) == set(hf) and all(torch.equal(again[k], hf[k]) for k in hf)
    left = dict(split)
    w = left.pop("transformer.encoder.layers.1.mlp.dense_h_to_4h.weight")
    left["transformer.encoder.layers.1.mlp.dense_left.weight"], left["transformer.encoder.layers.1.mlp.dense_right.weight"] = w.chunk(2)
    assert torch.equal(to_hf(ops, left, model.config)["model.layers.1.mlp.gate_up_proj.weight"], w)


@pytest.mark.parametrize("key,value", [("rmsnorm", False), ("apply_residual_connection_post_layernorm", True),
                                       ("post_layer_norm", False), ("add_bias_linear", True),
                                       ("apply_query_key_layer_scaling", False), ("pre_seq_len", 8)])
def test_chatglm_keys_hf_glm_cannot_express_are_refused(key, value):
    with pytest.raises(ValueError, match=rf"model\.model_config\.{key}="):
        chatglm_hf_config({**MC, key: value})


def test_chatglm_config_mapping():
    _, kw = chatglm_hf_config({**MC, "multi_query_attention": False})
    assert kw["num_key_value_heads"] == 4 and kw["head_dim"] == 16 and kw["rope_theta"] == 20000.0
    model = _hf_model(MC)
    cfg = model.config
    assert (cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == (2, 80, 96)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.5 and cfg.attention_bias
    n_params = sum(p.numel() for p in model.parameters())
    h, f, v, d = 64, 80, 96, 16
    per_layer = 2 * h + h * (4 + 2 * 2) * d + (4 + 2 * 2) * d + 4 * d * h + h * 2 * f + f * h
    assert n_params == 2 * v * h + h + 2 * per_layer
