"""The decoder block's structure beyond the Llama shape, from a YAML's `model_config` (ModelShape's head_dim,
qkv_bias, qk_norm, post_norms, gated_mlp, linear_bias, position_embeddings, tie_word_embeddings), for the parameter
count of model_params.py. Read for the families whose blocks differ and whose MindFormers / HF defaults are known:

- GLM: MindFormers ChatGLM2Config (1.3.2 models/glm2/glm2_config.py: kv_channels 128, add_qkv_bias True, untied
  output_layer) and HF `glm` / `glm4` / `glm4_moe` keys (GlmConfig / Glm4Config: attention_bias True, head_dim 128;
  Glm4MoeConfig: attention_bias False, use_qk_norm False, no head_dim key (hidden / heads); glm4 adds
  post_self_attn / post_mlp layernorms).
- GPT-2: MindFormers GPT2Config (1.3.2 models/gpt2/gpt2_config.py: expand_ratio 4, biases on every projection,
  LayerNorm with bias, a learned position table of max_position_embeddings or seq_length rows, the head tied to
  the word embedding).

Other families keep the Llama shape (no biases, head_dim = hidden / heads, untied head), as before.
"""
from __future__ import annotations

from typing import Any, Mapping

__all__ = ["model_traits"]

_GLM_TYPES = {"glm": True, "glm4": True, "glm4_moe": False}  # HF model_type -> attention_bias default


def _get(mc: Mapping, key: str, default: Any) -> Any:
    value = mc.get(key)
    return default if value is None or str(value) == "None" else value


def model_traits(mc: Mapping) -> dict[str, Any]:
    """ModelShape fields this model_config implies (empty for the Llama shape)."""
    kind, model_type = str(mc.get("type", "")), str(mc.get("model_type", "")).lower()
    if kind == "ChatGLM2Config":
        return {"head_dim": _get(mc, "kv_channels", 128), "qkv_bias": bool(_get(mc, "add_qkv_bias", True))}
    if model_type in _GLM_TYPES:
        return {"head_dim": _get(mc, "head_dim", 128) if model_type != "glm4_moe" else None,  # Glm4MoeConfig: h/n
                "qkv_bias": bool(_get(mc, "attention_bias", _GLM_TYPES[model_type])),
                "qk_norm": bool(_get(mc, "use_qk_norm", False)), "post_norms": model_type == "glm4",
                "tie_word_embeddings": bool(_get(mc, "tie_word_embeddings", False))}
    if kind == "GPT2Config":
        hidden, ratio = _get(mc, "hidden_size", 768), _get(mc, "expand_ratio", 4)
        out = {"gated_mlp": False, "linear_bias": True, "tie_word_embeddings": True,
               "position_embeddings": _get(mc, "max_position_embeddings", _get(mc, "seq_length", 1024))}
        if isinstance(hidden, int) and isinstance(ratio, int):  # else the size check names hidden_size
            out["ffn_hidden_size"] = hidden * ratio
        return out
    return {}
