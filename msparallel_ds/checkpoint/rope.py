"""A MindFormers YAML's rotary embedding as transformers 5's `rope_parameters` (where HF keeps rope_theta, the
scaling type and its fields, and partial_rotary_factor; a `rope_theta=` kwarg alone is dropped by a config filter).

Legacy `LlamaConfig` keys (mindformers 2.1.0 modules/layers.py:1142-1240 FreqsMgr): theta, extend_method in
None / NTK (theta *= scaling_factor) / PI (positions / scaling_factor, i.e. HF linear) / linear ({factor}) / YARN
({factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim}) / LLAMA3 ({factor,
low_freq_factor, high_freq_factor, original_max_position_embeddings}), scaling_factor.
2.x mcore keys (parallel_core/transformer_config_utils.py:403-411, transformer_config.py:2595-2603): theta |
rope_theta | rotary_base, an HF-form rope_scaling dict, position_embedding_type yarn with scaling_factor | factor |
rotary_scaling_factor and beta_fast, beta_slow, mscale, mscale_all_dim (original_max_position_embeddings is the
model's max_position_embeddings there), rotary_percent | partial_rotary_factor.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

__all__ = ["legacy_rope_parameters", "mcore_rope_parameters"]

_YARN = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
_LLAMA3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_NUMBERS = {"factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "low_freq_factor", "high_freq_factor",
            "attention_factor", "rope_theta", "partial_rotary_factor"}


def _error(key: str, value, rule: str, fix: str) -> ValueError:
    return ValueError(f"model.model_config.{key}={value!r} {rule}; {fix}")


def _num(key: str, value) -> float:
    try:
        return float(value)  # YAML 1.1 reads `1e6` (no dot) as a string
    except (TypeError, ValueError):
        raise _error(key, value, "is not a number", "write a number") from None


def _fields(key: str, value, needed: tuple[str, ...], kind: str) -> dict:
    if not isinstance(value, Mapping):
        raise _error(key, value, f"must be a mapping for extend_method {kind}", f"give {', '.join(needed)}")
    missing = [k for k in needed if k not in value]
    if missing:
        raise _error(key, dict(value), f"lacks {', '.join(missing)} (extend_method {kind} needs {', '.join(needed)})",
                     "add them as MindFormers requires (modules/layers.py _check_*_scaling_factor)")
    return {k: (int(value[k]) if k == "original_max_position_embeddings" else _num(f"{key}.{k}", value[k]))
            for k in needed}


def legacy_rope_parameters(mc: Mapping) -> dict:
    theta = _num("theta", mc.get("theta", 10000.0))
    method = str(mc.get("extend_method", "None"))
    sf = mc.get("scaling_factor", 1.0)
    if method == "None":
        return {"rope_type": "default", "rope_theta": theta}
    if method == "NTK":
        return {"rope_type": "default", "rope_theta": theta * _num("scaling_factor", sf)}
    if method == "PI":
        return {"rope_type": "linear", "rope_theta": theta, "factor": _num("scaling_factor", sf)}
    if method == "linear":
        return {"rope_type": "linear", "rope_theta": theta, **_fields("scaling_factor", sf, ("factor",), method)}
    if method == "YARN":
        return {"rope_type": "yarn", "rope_theta": theta, **_fields("scaling_factor", sf, _YARN, method)}
    if method == "LLAMA3":
        return {"rope_type": "llama3", "rope_theta": theta, **_fields("scaling_factor", sf, _LLAMA3, method)}
    raise _error("extend_method", method, "has no HF counterpart here (None, NTK, PI, linear, YARN and LLAMA3 do)",
                 "DYNAMIC_NTK only changes inference past max_position_embedding: import with extend_method: None")


def _first(mc: Mapping, *keys: str) -> Optional[tuple[str, Any]]:
    for k in keys:
        if mc.get(k) is not None:
            return k, mc[k]
    return None


def mcore_rope_parameters(mc: Mapping, base: Mapping) -> Optional[dict]:
    """rope_parameters from the YAML's keys over those of the pretrained config.json (`base`, HF keys: old
    rope_theta / rope_scaling or new rope_parameters); None when neither says anything (the HF default)."""
    params: dict[str, Any] = dict(base.get("rope_parameters") or {})
    if base.get("rope_scaling"):
        params.update(base["rope_scaling"])
    if base.get("rope_theta") is not None:
        params["rope_theta"] = base["rope_theta"]
    if isinstance(mc.get("rope_scaling"), Mapping):
        params = {k: v for k, v in params.items() if k in ("rope_theta", "partial_rotary_factor")}
        params.update(mc["rope_scaling"])
    elif mc.get("rope_scaling") is not None:
        raise _error("rope_scaling", mc["rope_scaling"], "must be a mapping (HF's form: rope_type, factor, ...)",
                     "write it as in the model's config.json")
    if "type" in params:
        params["rope_type"] = params.pop("type")
    theta = _first(mc, "rope_theta", "theta", "rotary_base")
    if theta:
        params["rope_theta"] = theta[1]
    kind = str(mc.get("position_embedding_type", "rope"))
    if kind == "yarn":
        params["rope_type"] = "yarn"
        factor = _first(mc, "rotary_scaling_factor", "scaling_factor", "factor")
        if factor:
            params["factor"] = factor[1]
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            if mc.get(key) is not None:
                params[key] = mc[key]
        original = _first(mc, "original_max_position_embeddings", "max_position_embeddings")
        if original and "original_max_position_embeddings" not in params:
            params["original_max_position_embeddings"] = int(original[1])
    elif kind not in ("rope", "partial_rope"):
        raise _error("position_embedding_type", kind, "has no HF rotary counterpart here (rope and yarn do)",
                     "use a 2.x YAML with position_embedding_type rope or yarn")
    if mc.get("use_rope_scaling"):
        raise _error("use_rope_scaling", True, "(Megatron's llama3.1 scaling) is not mapped",
                     "write the HF form instead: rope_scaling: {rope_type: llama3, factor, low_freq_factor, "
                     "high_freq_factor, original_max_position_embeddings}")
    if mc.get("rotary_seq_len_interpolation_factor") not in (None, 1, 1.0):
        params["rope_type"], params["factor"] = "linear", mc["rotary_seq_len_interpolation_factor"]
    partial = _first(mc, "partial_rotary_factor", "rotary_percent")
    if partial:
        params["partial_rotary_factor"] = partial[1]
    if not params:
        return None
    params.setdefault("rope_type", "default")
    return {k: (_num(k, v) if k in _NUMBERS else v) for k, v in params.items()}
