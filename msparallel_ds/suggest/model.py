"""The model suggest searches layouts for: an HF config.json or a MindFormers YAML (its model.model_config, legacy or
mcore/HF key spellings, and moe_config), reduced to the shape numbers the cost model needs plus the YAML dict every
candidate starts from (the input YAML itself, or a minimal one holding the model_config read from config.json)."""
from __future__ import annotations

import copy
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

from ..config.errors import ConfigError, ConfigIssue
from ..config.mindformers import load_config
from ..model_params import attention, ffn_size

# HF config.json key -> MindFormers legacy model_config key
HF_KEYS = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
           "num_key_value_heads": "n_kv_heads", "hidden_size": "hidden_size", "intermediate_size": "ffn_hidden_size",
           "vocab_size": "vocab_size", "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
           "qk_rope_head_dim": "qk_rope_head_dim", "qk_nope_head_dim": "qk_nope_head_dim", "v_head_dim": "v_head_dim"}
HF_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
# the parallel keys suggest owns: dropped from a shape-only load so a bad strategy does not hide the model
PARALLEL_KEYS = ("parallel_config", "parallel", "parallelism", "recompute_config", "micro_batch_interleave_num",
                 "swap_config")
LAYOUT_KEYS = ("fine_grain_interleave", "offset", "pp_interleave_num", "use_ring_attention")


@dataclass(frozen=True)
class ModelSpec:
    """Shape numbers (h = hidden, a = heads, L = layers, V = vocab) and the YAML dict candidates are built from."""

    base: dict
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_length: int
    global_batch: Optional[int]
    dense_layer_params: int     # matmul parameters of a dense decoder layer (attention + feed-forward)
    moe_layer_params: int = 0   # matmul parameters a token goes through in a MoE layer (attention, shared, top_k)
    experts: int = 0
    top_k: int = 1
    dense_layers: int = 0       # leading dense layers of a MoE model (first_k_dense_replace)
    source: str = ""
    parallel_mode: str = "semi_auto_parallel"
    notes: tuple = field(default=())

    @property
    def moe(self) -> bool:
        return self.experts > 1

    @property
    def moe_layers(self) -> int:
        return max(self.layers - self.dense_layers, 0) if self.moe else 0

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)


def _read(path_or_dict: Any) -> tuple[dict, str]:
    if isinstance(path_or_dict, Mapping):
        return copy.deepcopy(dict(path_or_dict)), "<dict>"
    p = Path(path_or_dict)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError([ConfigIssue("--model", str(p), f"cannot be read: {exc.strerror or exc}",
                                       "pass an HF config.json or a MindFormers YAML")]) from None
    data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ConfigError([ConfigIssue("--model", str(p), "is not a mapping", "pass config.json or a YAML")])
    return data, str(p)


def _from_hf(hf: dict) -> dict:
    """config.json -> a minimal MindFormers YAML dict (legacy keys; MoE as moe_config)."""
    mc = {ours: hf[k] for k, ours in HF_KEYS.items() if hf.get(k) is not None}
    mc.update(compute_dtype="bfloat16", param_init_type="float32", use_flash_attention=True)
    out: dict[str, Any] = {"model": {"model_config": mc}}
    experts = next((hf[k] for k in HF_EXPERTS if hf.get(k)), None)
    if experts and experts > 1:
        moe = {"expert_num": experts, "num_experts_chosen": hf.get("num_experts_per_tok") or 1,
               "routing_policy": "TopkRouterV2"}
        if hf.get("moe_intermediate_size"):
            moe["moe_intermediate_size"] = hf["moe_intermediate_size"]
        if hf.get("first_k_dense_replace"):
            moe["first_k_dense_replace"] = hf["first_k_dense_replace"]
        shared = hf.get("n_shared_experts") or (1 if hf.get("shared_expert_intermediate_size") else 0)
        if shared:
            moe["shared_expert_num"] = shared
        out["moe_config"] = moe
    return out


def is_hf_config(data: Mapping) -> bool:
    return "model" not in data and "num_hidden_layers" in data


def read_model(source: Any, seq_length: Optional[int] = None, global_batch: Optional[int] = None) -> ModelSpec:
    """An HF config.json / MindFormers YAML (path or dict) -> ModelSpec. seq_length / global_batch override the file's
    (the YAML's global batch is its plan's: batch_size x dp x micro_batch_num x micro_batch_interleave_num ...)."""
    data, label = _read(source)
    notes = []
    if is_hf_config(data):
        base = _from_hf(data)
        gb_file = None
        mode = "semi_auto_parallel"
    else:
        base = data
        gb_file, mode = _yaml_batch(data)
    mc = base.setdefault("model", {}).setdefault("model_config", {})
    if seq_length:
        mc["seq_length"] = seq_length
    shape_only = {k: v for k, v in base.items() if k not in PARALLEL_KEYS}
    # the layout-dependent model_config keys would trip rules against the parallel keys just dropped
    shape_only["model"] = {**base["model"], "model_config": {k: v for k, v in mc.items() if k not in LAYOUT_KEYS}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config(shape_only, name=label)
    m = cfg.model
    missing = [k for k in ("num_layers", "num_heads", "hidden_size", "vocab_size", "seq_length")
               if getattr(m, k) is None]
    if missing:
        raise ConfigError([ConfigIssue("model.model_config", label, f"lacks {', '.join(missing)}",
                                       "add them (or pass --seq-length for the sequence length)")])
    mc.setdefault("seq_length", m.seq_length)  # mcore YAMLs take it from the dataset: make it explicit
    ffn = ffn_size(cfg)
    attn = attention(m).total
    dense = attn + 3 * m.hidden_size * ffn
    s = cfg.moe
    experts = s.num_experts if s is not None and s.num_experts else 0
    top_k, moe_params, dense_first = 1, 0, 0
    if experts > 1:
        top_k = s.top_k or 1
        moe_params = attn + 3 * m.hidden_size * (s.shared_size(ffn) + top_k * s.expert_size(ffn))
        dense_first = s.dense_layers
    gb = global_batch or gb_file
    if gb_file and global_batch and gb_file != global_batch:
        notes.append(f"global batch {global_batch} (the YAML's is {gb_file})")
    return ModelSpec(base=base, layers=cfg.pipeline_layers, hidden=m.hidden_size, heads=m.num_heads,
                     kv_heads=m.kv_heads, ffn=ffn, vocab=m.vocab_size, seq_length=m.seq_length, global_batch=gb,
                     dense_layer_params=dense, moe_layer_params=moe_params, experts=experts, top_k=top_k,
                     dense_layers=dense_first, source=label, parallel_mode=mode, notes=tuple(notes))


def _yaml_batch(data: dict) -> tuple[Optional[int], str]:
    """(the YAML's global batch, its parallel_mode) when its own strategy loads; (None, mode) otherwise."""
    from ..plan import make_plan

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = load_config(data)
            return make_plan(cfg).global_batch_size, cfg.parallel.parallel_mode
    except ConfigError:
        return None, "semi_auto_parallel"


def hand_written_world(source: Any) -> int:
    """The world size a YAML's own degrees describe (dp x tp x cp x pp)."""
    from ..plan import make_plan

    data, _ = _read(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_plan(load_config(data)).world_size
