"""YAML front-end: a MindFormers file (legacy or mcore `parallel_config`, or the newer `parallelism:` schema)
-> ParallelConfig. Every failure becomes a ConfigError naming the YAML key; nothing else escapes."""
from __future__ import annotations

import dataclasses
import difflib
import warnings
from typing import Any, Mapping

from pydantic import ValidationError

from .errors import ConfigError, ConfigIssue, ConfigWarning
from .model_traits import model_traits
from .modes import apply_mode_resets
from .moe import read_moe
from .pet import read_pet
from .parallelism import PARALLELISM_FIELDS, apply_parallelism, apply_recompute, apply_training  # noqa: F401
from .reader import MAX_DEPTH, check_depth, read_source
from .rules import check_rules
from .schema import PARALLELISM_KEYS, ParallelConfig, ParallelConfigSection


PARALLEL_MODE_NAMES = {0: "data_parallel", 1: "semi_auto_parallel", 2: "auto_parallel", 3: "hybrid_parallel"}
# MindFormers' string spellings (tools/utils.py); MANUAL_PARALLEL is its alias of STAND_ALONE (the model code places
# its own communication), so it runs stand-alone / data parallel like STAND_ALONE
PARALLEL_MODE_STRINGS = {"DATA_PARALLEL": "data_parallel", "SEMI_AUTO_PARALLEL": "semi_auto_parallel",
                         "AUTO_PARALLEL": "auto_parallel", "HYBRID_PARALLEL": "hybrid_parallel",
                         "STAND_ALONE": "stand_alone", "MANUAL_PARALLEL": "stand_alone"}

# model.model_config spellings: ours <- (legacy, mcore/HF, GLM)
MODEL_ALIASES = {
    "num_layers": ("num_layers", "num_hidden_layers"),
    "mtp_depth": ("mtp_depth", "num_nextn_predict_layers", "mtp_num_layers"),
    "num_heads": ("num_heads", "num_attention_heads"),
    "n_kv_heads": ("n_kv_heads", "num_key_value_heads", "num_query_groups", "multi_query_group_num"),
    "hidden_size": ("hidden_size",),
    "ffn_hidden_size": ("ffn_hidden_size", "intermediate_size"),
    "seq_length": ("seq_length",),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "q_lora_rank": ("q_lora_rank",),
    "kv_lora_rank": ("kv_lora_rank",),
    "qk_rope_head_dim": ("qk_rope_head_dim", "qk_pos_emb_head_dim"),  # Megatron-Core MLATransformerConfig names
    "qk_nope_head_dim": ("qk_nope_head_dim", "qk_head_dim"),  # Megatron's qk_head_dim excludes the rope part
    "v_head_dim": ("v_head_dim",),
    "mtp_loss_factor": ("mtp_loss_factor", "mtp_loss_scaling_factor"),
    "dsa_indexer_loss_coeff": ("dsa_indexer_loss_coeff",),
    "compute_dtype": ("compute_dtype",),
    "param_init_type": ("param_init_type", "params_dtype"),
    "fine_grain_interleave": ("fine_grain_interleave",),
    "use_ring_attention": ("use_ring_attention",),
    "use_flash_attention": ("use_flash_attention",),
    "pp_interleave_num": ("pp_interleave_num",),
    "offset": ("offset",),
}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                 "bf16": "bfloat16"}


def load_config(source: Any, *, name: str | None = None) -> ParallelConfig:
    """A path, a mapping or YAML text -> validated ParallelConfig. Raises ConfigError, and only ConfigError."""
    label = name
    try:
        raw, label = read_source(source, label)
        return _build(raw, label)
    except ConfigError:
        raise
    except RecursionError:
        raise ConfigError([ConfigIssue("", "<document>", "is nested too deeply to be a MindFormers config",
                                       f"keep nesting under {MAX_DEPTH} levels")], label) from None
    except Exception as exc:  # hostile input must never surface as another exception type
        raise ConfigError([ConfigIssue("", type(exc).__name__, f"could not be read as a configuration: {exc}",
                                       "pass a MindFormers YAML file, YAML text or a dict")], label) from None


def _build(raw: Any, label: str | None) -> ParallelConfig:
    if raw is None:
        raise ConfigError([ConfigIssue("", "<empty>", "the document is empty",
                                       "write a MindFormers YAML with a parallel_config section")], label)
    if not isinstance(raw, Mapping):
        raise ConfigError([ConfigIssue("", type(raw).__name__, "the top level must be a mapping of keys",
                                       "write `parallel_config:`, `parallel:` etc. as top-level keys")], label)
    check_depth(raw)
    issues: list[ConfigIssue] = []
    spelled: dict[str, str] = {}  # our key path -> the spelling the YAML used (mcore/HF names)
    data = _normalize(raw, issues, spelled)
    if issues:
        raise ConfigError(issues, label)
    try:
        cfg = ParallelConfig.model_validate(data)
    except ValidationError as exc:
        uses_parallelism = data.get("parallelism") is not None
        found: dict[str, ConfigIssue] = {}
        for err in exc.errors():  # a union reports once per branch: keep one issue per key
            issue = _issue_from_pydantic(err, uses_parallelism)
            found.setdefault(issue.key, issue)
        raise ConfigError(_as_written(list(found.values()), spelled), label) from None
    issues = check_rules(cfg)
    moe, moe_issues = read_moe(_pynative_model(raw), cfg)  # moe_config / mcore MoE keys, their rules (config.moe)
    pet, pet_issues = read_pet(raw, cfg)  # model_config.pet_config: LoRA (config.pet)
    if issues or moe_issues or pet_issues:
        raise ConfigError(_as_written(issues, spelled) + moe_issues + pet_issues, label)
    extra = {k: v for k, v in (("moe", moe), ("pet", pet)) if v is not None}
    return cfg.model_copy(update=extra) if extra else cfg


def _pynative_model(raw: Mapping) -> Mapping:
    """MindFormers 2.1 pynative files keep the model's keys right under `model:`; the MoE reader looks for them under
    model.model_config (the mcore layout), so hand it that view."""
    model = raw.get("model")
    if raw.get("parallelism") is None or not isinstance(model, Mapping) or model.get("model_config") is not None:
        return raw
    return {**raw, "model": {"model_config": model}}


def _as_written(issues: list[ConfigIssue], spelled: dict[str, str]) -> list[ConfigIssue]:
    return [dataclasses.replace(i, key=spelled.get(i.key, i.key)) for i in issues]


def _section(raw: Mapping, key: str, issues: list[ConfigIssue], path: str | None = None) -> dict:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        issues.append(ConfigIssue(path or key, value, "must be a mapping", f"write `{key}:` with indented keys"))
        return {}
    bad = [k for k in value if not isinstance(k, str)]
    for k in bad:
        issues.append(ConfigIssue(f"{path or key}.{k}", k, "is not a valid key name", "use string keys"))
    return {k: v for k, v in value.items() if isinstance(k, str) and v is not None}


def _normalize(raw: Mapping, issues: list[ConfigIssue], spelled: dict[str, str]) -> dict:
    """Reshape any supported spelling into ParallelConfig's field layout (validation comes after)."""
    out: dict[str, Any] = {}
    pc = _section(raw, "parallel_config", issues)
    nested_recompute = pc.pop("recompute", None)  # TransformerOpParallelConfig takes recompute too
    allowed = set(ParallelConfigSection.model_fields)
    for key in list(pc):
        if key not in allowed:
            close = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.6)
            fix = f"did you mean `{close[0]}`?" if close else f"valid keys: {', '.join(sorted(allowed))}"
            issues.append(ConfigIssue(f"parallel_config.{key}", pc.pop(key),
                                      "is not a MindFormers parallel_config key", fix))
    if "optimizer_shard" in pc:
        warnings.warn("parallel_config.optimizer_shard is deprecated in MindFormers and has no effect; "
                      "use parallel.enable_parallel_optimizer", ConfigWarning, stacklevel=4)
    if isinstance(pc.get("context_parallel_algo"), str) and pc["context_parallel_algo"] == "hybird_cp":
        pc["context_parallel_algo"] = "hybrid_cp"  # MindFormers r1.3-r1.5 spelling
    out["parallel_config"] = pc

    par = _section(raw, "parallel", issues)
    mode = par.get("parallel_mode")
    if isinstance(mode, int) and not isinstance(mode, bool) and mode in PARALLEL_MODE_NAMES:
        par["parallel_mode"] = PARALLEL_MODE_NAMES[mode]
    elif isinstance(mode, str) and mode.upper() in PARALLEL_MODE_STRINGS:
        if mode.upper() == "MANUAL_PARALLEL":
            warnings.warn(f"parallel.parallel_mode={mode}: MindFormers runs MANUAL_PARALLEL as STAND_ALONE (the model "
                          "places its own communication: tools/utils.py:44); it runs as stand_alone here",
                          ConfigWarning, stacklevel=4)
        par["parallel_mode"] = PARALLEL_MODE_STRINGS[mode.upper()]
    if par.get("auto_pipeline") is True:
        warnings.warn("parallel.auto_pipeline=true: MindFormers 2.1 does not choose pipeline stages (it stops with "
                      "'Automatic pipeline stage is unavailable for now', core/context/parallel.py:49-52); "
                      "parallel_config.pipeline_stage is used as written; `msparallel-ds suggest` searches pipeline "
                      "layouts", ConfigWarning, stacklevel=4)
    for sub in ("parallel_optimizer_config", "pipeline_config"):
        if sub in par:
            par[sub] = _section(par, sub, issues, f"parallel.{sub}")
    out["parallel"] = par

    for key in ("micro_batch_interleave_num", "use_parallel", "use_legacy", "pretrained_model_dir"):
        if raw.get(key) is not None:
            out[key] = raw[key]
    flag = out.get("use_parallel")
    if flag is not None and not isinstance(flag, bool):  # e.g. `use_parallel: Flase` in a real config
        warnings.warn(f"use_parallel={flag!r} is not a boolean; MindFormers tests only its truthiness, so it counts "
                      f"as {bool(flag)}: write true or false", ConfigWarning, stacklevel=4)
        out["use_parallel"] = bool(flag)
    recompute = _section(raw, "recompute_config", issues)
    if not recompute and isinstance(nested_recompute, Mapping):
        recompute = {k: v for k, v in nested_recompute.items() if v is not None}
    elif not recompute and isinstance(nested_recompute, (bool, list)):
        recompute = {"recompute": nested_recompute}
    out["recompute_config"] = recompute
    out["swap_config"] = _swap_config(raw, issues)
    out["runner_config"] = _section(raw, "runner_config", issues)
    out["runner_wrapper"] = _runner_wrapper(_section(raw, "runner_wrapper", issues), issues)
    for key in ("optimizer", "lr_schedule", "grouped_lr_schedule"):
        if raw.get(key) is not None:
            out[key] = _section(raw, key, issues)
    out["model"] = _model_shape(raw, issues, spelled)

    if raw.get("parallelism") is not None:  # MindFormers 2.1 pynative schema (config.parallelism)
        apply_parallelism(_section(raw, "parallelism", issues), out, issues)
        if raw.get("training") is not None:
            apply_training(_section(raw, "training", issues), out)
        out.setdefault("use_legacy", False)  # pynative models: MTP sits after the decoder layers, outside the split
        if raw.get("lr_scheduler") is not None and raw.get("lr_schedule") is None:  # 2.1 pynative's name for it
            out["lr_schedule"] = _section(raw, "lr_scheduler", issues)
        if raw.get("recompute") is not None and not out["recompute_config"]:
            apply_recompute(_section(raw, "recompute", issues), out, issues)
    apply_mode_resets(out, issues, raw.get("run_mode"))
    return out


def _swap_config(raw: Mapping, issues: list[ConfigIssue]) -> dict:
    """`swap_config:`, or mcore's model_config.cpu_offloading (+ cpu_offloading_num_layers in layer_swap's format,
    transformer_config_utils.py), which feed the same swap of layer activations to the host."""
    swap = _section(raw, "swap_config", issues)
    model = raw.get("model")
    mc = model.get("model_config") if isinstance(model, Mapping) else None
    if not swap and isinstance(mc, Mapping) and mc.get("cpu_offloading") is not None:
        swap = {"swap": mc["cpu_offloading"]}
        if mc.get("cpu_offloading_num_layers") is not None:
            swap["layer_swap"] = mc["cpu_offloading_num_layers"]
    return swap


def _runner_wrapper(rw: dict, issues: list[ConfigIssue]) -> dict:
    scale = rw.get("scale_sense")
    if isinstance(scale, Mapping):
        kind_name = scale.get("type", "DynamicLossScaleUpdateCell")
        if not isinstance(kind_name, str):
            issues.append(ConfigIssue("runner_wrapper.scale_sense.type", kind_name, "must name a loss-scale cell",
                                      "write DynamicLossScaleUpdateCell or FixedLossScaleUpdateCell"))
            return {}
        kind = "static" if "Fixed" in kind_name or "Constant" in kind_name else "dynamic"
        rw["scale_sense"] = {k: v for k, v in {"kind": kind, "value": scale.get("loss_scale_value"),
                                               "factor": scale.get("scale_factor"),
                                               "window": scale.get("scale_window")}.items() if v is not None}
    elif scale is not None:
        rw["scale_sense"] = {"kind": "static", "value": scale}
    return rw


def _model_shape(raw: Mapping, issues: list[ConfigIssue], spelled: dict[str, str]) -> dict:
    model = raw.get("model")
    if model is None:
        return {}
    if not isinstance(model, Mapping):
        issues.append(ConfigIssue("model", model, "must be a mapping", "write `model:` with `model_config:` under it"))
        return {}
    if model.get("model_config") is None and (raw.get("parallelism") is not None or raw.get("training") is not None):
        # MindFormers 2.1 pynative layout: the model's keys sit right under `model:` (pynative/config ModelConfig)
        mc = {k: v for k, v in model.items() if isinstance(k, str) and v is not None and not isinstance(v, Mapping)}
    else:
        mc = _section(model, "model_config", issues, "model.model_config")
    shape: dict[str, Any] = {}
    for field, spellings in MODEL_ALIASES.items():
        for spelling in spellings:
            if mc.get(spelling) is not None:
                shape[field] = mc[spelling]
                if spelling != field:
                    spelled[f"model.model_config.{field}"] = f"model.model_config.{spelling}"
                break
    for field, value in model_traits(mc).items():  # GLM / GPT-2 block structure (config/model_traits.py)
        shape.setdefault(field, value)
    if "kv_channels" in mc and "head_dim" not in mc:
        spelled["model.model_config.head_dim"] = "model.model_config.kv_channels"
    data = raw.get("train_dataset")  # mcore models train at the dataset's length (GPTDataset config.seq_length)
    data = data.get("data_loader") if isinstance(data, Mapping) else None
    data = data.get("config") if isinstance(data, Mapping) else None
    if "seq_length" not in shape and raw.get("use_legacy") is False and isinstance(data, Mapping) \
            and data.get("seq_length") is not None:
        shape["seq_length"] = data["seq_length"]
        spelled["model.model_config.seq_length"] = "train_dataset.data_loader.config.seq_length"
    if mc.get("multi_query_attention") is False and "n_kv_heads" in shape and "n_kv_heads" not in mc \
            and "num_key_value_heads" not in mc:
        shape.pop("n_kv_heads")  # GLM: multi_query_group_num only counts with multi_query_attention
    for field in ("compute_dtype", "param_init_type"):
        if isinstance(shape.get(field), str):
            shape[field] = DTYPE_ALIASES.get(shape[field].lower(), shape[field].lower())
    return shape




def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_SECTION_PATHS = {"model": "model.model_config"}
_TYPE_TAGS = {"bool", "int", "str", "float", "list", "dict", "tuple", "none", "is-instance", "lax-or-strict"}


def _issue_from_pydantic(err: Mapping, uses_parallelism: bool) -> ConfigIssue:
    parts: list[str] = []
    for p in err.get("loc", ()):
        if isinstance(p, int):
            if parts:
                parts[-1] += f"[{p}]"
        elif p not in _TYPE_TAGS and not any(ch in p for ch in "[]()"):
            parts.append(p)  # pydantic labels union branches with type names; those are not YAML keys
    if parts and parts[0] in _SECTION_PATHS:
        parts[0] = _SECTION_PATHS[parts[0]]
    if parts[:2] == ["runner_wrapper", "scale_sense"]:
        parts = parts[:2]
    key = ".".join(parts)
    if uses_parallelism and key in PARALLELISM_KEYS:
        key = PARALLELISM_KEYS[key]
    value = err.get("input")
    if isinstance(value, (dict, list)):
        value = type(value).__name__
    return ConfigIssue(key or "<root>", value, _rule_text(err, err.get("msg", "is invalid")), _fix_text(err))


def _rule_text(err: Mapping, msg: str) -> str:
    kind = err.get("type", "")
    ctx = err.get("ctx") or {}
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected', '')}"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        return f"is out of range: {msg.lower()}"
    if kind == "extra_forbidden":
        return "is not a known key"
    return f"is invalid: {msg}"


def _fix_text(err: Mapping) -> str:
    kind = err.get("type", "")
    if kind.startswith("int") or kind in ("greater_than_equal", "less_than_equal"):
        return "write a positive whole number within range"
    if kind.startswith("bool"):
        return "write true or false"
    if kind == "literal_error":
        return "use one of the listed values"
    if kind.startswith("float"):
        return "write a finite number"
    return "see the MindFormers documentation for this key"
