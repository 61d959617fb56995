"""The model a MindFormers YAML describes, as a HF config plus the facts its checkpoint layout depends on.

    model = model_from_yaml("run.yaml")
    model.hf_config, model.adapter, model.legacy, model.ops    # ops: the family's weight map for this checkpoint

Legacy YAMLs (`use_legacy: true`, the default; `model_config: {type: LlamaConfig, ...}`) use MindFormers' own
keys (mindformers 2.1.0 models/llama/llama_config.py:132-176): num_layers, num_heads, n_kv_heads, theta,
max_position_embedding, intermediate_size or multiple_of / ffn_dim_multiplier, qkv_has_bias, qkv_concat.
2.x mcore YAMLs (`use_legacy: false`) carry HF keys plus model_type / architectures, on top of the config.json in
`pretrained_model_dir` when that folder exists (how MindFormers 2.x builds the model).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .rope import mcore_rope_parameters
__all__ = ["MindFormersModel", "model_from_yaml"]


@dataclass
class MindFormersModel:
    hf_config: Any
    adapter: Any
    legacy: bool
    qkv_concat: bool          # export: write the fused form (legacy qkv_concat; mcore always fuses)
    ops: list


def _error(path, key: str, value, rule: str, fix: str) -> ValueError:
    return ValueError(f"{path}: model.model_config.{key}={value!r} {rule}; {fix}")


def _mcore_config(mc: Mapping, raw: Mapping, path) -> tuple[str, dict]:
    from transformers import AutoConfig

    kw: dict[str, Any] = {}
    base = raw.get("pretrained_model_dir")
    if base and (Path(str(base)) / "config.json").is_file():
        kw.update(json.loads((Path(str(base)) / "config.json").read_text()))
    model_type = mc.get("model_type") or kw.get("model_type")
    if not model_type:
        raise _error(path, "model_type", None, "is needed for a 2.x (use_legacy: false) YAML",
                     "add model_type (e.g. qwen3) or a pretrained_model_dir holding the HF config.json")
    try:
        default = AutoConfig.for_model(str(model_type))
    except ValueError:
        raise _error(path, "model_type", model_type, "is not a transformers model type", "use the HF model_type")
    defaults = default.to_dict()
    aliases = getattr(default, "attribute_map", {})  # e.g. Qwen3-MoE's num_experts -> num_local_experts
    kw.update({k: _like(defaults.get(aliases.get(k, k)), v) for k, v in mc.items()
               if (k in defaults or k in aliases) and k not in ("model_type", "transformers_version")})
    if str(model_type) == "deepseek_v4":  # the 2.1 pynative YAML's own keys (compress_ratios, csa_window_size, ...)
        from ..models.deepseek4_names import hf_config_keys

        try:
            kw.update(hf_config_keys(mc))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    if mc.get("hidden_act") == "swiglu":  # MindFormers' gated SiLU MLP is HF's silu act with gate/up projections
        kw["hidden_act"] = "silu"
    if "untie_embeddings_and_output_weights" in mc and "tie_word_embeddings" not in mc:
        kw["tie_word_embeddings"] = not mc["untie_embeddings_and_output_weights"]
    rope = mcore_rope_parameters(mc, kw)
    for key in ("rope_theta", "rope_scaling", "partial_rotary_factor"):  # all kept in rope_parameters now
        kw.pop(key, None)
    if rope is not None:
        kw["rope_parameters"] = rope
    _fit_layer_types(kw, path)
    archs = mc.get("architectures") or kw.get("architectures")
    if archs:
        kw["architectures"] = [archs] if isinstance(archs, str) else list(archs)
    kw.pop("model_type", None)
    return str(model_type), kw


def _fit_layer_types(kw: dict, path) -> None:
    """A folder's config.json lists one attention type per layer; a YAML that sets another num_hidden_layers keeps
    a uniform list uniform (one entry per layer, as HF builds it by default) and refuses a mixed one."""
    types, n = kw.get("layer_types"), kw.get("num_hidden_layers")
    if not isinstance(types, list) or not isinstance(n, int) or len(types) == n:
        return
    if len(set(types)) > 1:
        raise _error(path, "num_hidden_layers", n, f"differs from the {len(types)} per-layer attention types "
                     "(layer_types) of pretrained_model_dir's config.json, which mixes several",
                     "set model_config.layer_types with one entry per layer, or keep the folder's layer count")
    kw["layer_types"] = types[:1] * n


# model_config sizes (MindFormers legacy and 2.x names) that must be positive integers when given
_SIZES = {"num_layers", "num_heads", "n_kv_heads", "hidden_size", "intermediate_size", "vocab_size",
          "num_attention_heads", "num_query_groups", "num_key_value_heads", "ffn_hidden_size", "kv_channels",
          "head_dim", "seq_length"}


def _like(default: Any, value: Any) -> Any:
    """YAML 1.1 reads `1e-6` (no dot) as a string: a number where the HF default is one."""
    if isinstance(value, str) and isinstance(default, (int, float)) and not isinstance(default, bool):
        try:
            return float(value) if isinstance(default, float) else int(value)
        except ValueError:
            return value
    return value


def model_from_yaml(path: str | Path, *, legacy_fused_layout: str = "interleaved") -> MindFormersModel:
    """The YAML's model (its `model.model_config`) and weight map. legacy_fused_layout: how a legacy checkpoint's
    fused w_qkv / w_gate_hidden are laid out ("interleaved": MindFormers >= 1.6 incl. 2.x; "concat": 1.3.x)."""
    import yaml
    from transformers import AutoConfig

    from ..models import adapter_for_config
    from ..models.llama import legacy_hf_config

    raw = yaml.safe_load(Path(path).read_text())
    mc = ((raw or {}).get("model") or {}).get("model_config") if isinstance(raw, Mapping) else None
    pynative = isinstance(raw, Mapping) and mc is None and raw.get("parallelism") is not None
    if pynative and isinstance(raw.get("model"), Mapping):  # MindFormers 2.1 pynative: the keys sit under `model:`
        mc = raw["model"]
    if not isinstance(mc, Mapping):
        raise ValueError(f"{path}: no model: / model.model_config section: the YAML of the run that wrote the checkpoint is "
                         "needed (it describes the model)")
    if legacy_fused_layout not in ("interleaved", "concat"):
        raise ValueError(f"legacy fused layout {legacy_fused_layout!r} must be 'interleaved' or 'concat'")
    for key in _SIZES.intersection(mc):
        value = mc[key]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise _error(path, key, value, "must be a positive integer", "write the model's size, e.g. 32")
    legacy = raw.get("use_legacy", True) is not False and not pynative  # pynative models are mcore-style
    if legacy and not mc.get("type"):  # e.g. general/run_general_task.yaml: a template with no model in it
        raise ValueError(f"{path}: model.model_config names no model (no `type`, e.g. LlamaConfig, and no "
                         f"`use_legacy: false` + model_type): keys {sorted(mc) or 'none'}; the YAML of the run that "
                         "wrote the checkpoint is needed: fill its model: section (model_config with the "
                         "architecture) instead of a template")
    if legacy:
        try:
            moe = raw.get("moe_config")
            model_type, kw = _legacy_family_config(mc) or legacy_hf_config(
                mc, moe if isinstance(moe, Mapping) else None)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: model.model_config: {e}") from None
    else:
        model_type, kw = _mcore_config(mc, raw, path)
    try:
        hf_config = AutoConfig.for_model(model_type, **kw)
    except (TypeError, ValueError, ArithmeticError) as e:  # HF's strict config fields name the key
        last = str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: model.model_config does not make a {model_type} HF config: {last}") from None
    if not getattr(hf_config, "architectures", None):
        hf_config.architectures = [_causal_lm_name(model_type)]
    try:
        adapter = adapter_for_config(hf_config)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    partial = (getattr(hf_config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    if float(partial) != 1.0 and _rotates_whole_head(hf_config):
        raise ValueError(f"{path}: model.model_config partial rotary factor (rotary_percent / partial_rotary_factor) "
                         f"{partial}: HF {model_type} rotates whole heads and would ignore it (silently other "
                         "logits); only 1.0 imports for this family")
    if legacy:
        ops = adapter.mindformers_weights(hf_config, legacy=True, qkv_interleaved=legacy_fused_layout == "interleaved")
        # ChatGLM2Config: 1.3.x has only the fused query_key_value (no qkv_concat key), so absent means fused
        qkv_concat = bool(mc.get("qkv_concat", model_type == "glm"))
    else:
        ops = adapter.mindformers_weights(
            hf_config, legacy=False,
            qkv_interleaved=not mc.get("use_contiguous_weight_layout_attention", False),
            fc1_interleaved=bool(mc.get("use_interleaved_weight_layout_mlp", True)))
        # mcore fuses q/k/v always; MLA's down projections only with mla_qkv_concat (2.1 transformer_config.py:210)
        qkv_concat = bool(mc.get("mla_qkv_concat", True)) if mc.get("multi_latent_attention") or \
            model_type == "deepseek_v3" else True
    return MindFormersModel(hf_config, adapter, legacy, qkv_concat, ops)


def _rotates_whole_head(hf_config) -> bool:
    """Whether the HF model ignores partial_rotary_factor (Llama-like families do): its rotary table, built on the
    meta device, has head_dim / 2 frequencies."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    sizes = {b.numel() for n, b in model.named_buffers() if n.endswith("inv_freq")}
    return head_dim // 2 in sizes


def _legacy_family_config(mc: Mapping):
    """(model_type, HF config kwargs) of a legacy model_config of a non-Llama family (models/glm.py, gpt2.py), or
    None for the Llama family's LlamaConfig."""
    from ..models import family_name, unsupported_advice
    from ..models.glm import chatglm_hf_config
    from ..models.gpt2 import gpt2_hf_config

    kind = str(mc.get("type", "LlamaConfig"))
    fn = {"ChatGLM2Config": chatglm_hf_config, "GPT2Config": gpt2_hf_config}.get(kind)
    if fn is None and family_name(kind):  # TeleChat, Baichuan, InternLM, CogVLM2, Whisper YAMLs
        raise ValueError(f"model.model_config.type={kind!r}: no HF model is imported for it: "
                         f"{unsupported_advice(kind, None)}")
    return fn(mc) if fn else None


def _causal_lm_name(model_type: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, f"{model_type}ForCausalLM")
