"""The run's model: HF architecture from model.model_config (the importer's YAML -> HF config mapping) or from
pretrained_model_dir; weights from a HF folder, an engine.save checkpoint, or a MindSpore checkpoint through the
importer (load_checkpoint + src_strategy_path_or_dir); otherwise random init seeded by `seed`."""
from __future__ import annotations

import glob
import os
from typing import Mapping, Optional

import torch

from ..config.errors import ConfigError, ConfigIssue


def _err(key, value, rule, fix=""):
    return ConfigError(ConfigIssue(key, value, rule, fix))


def _is_hf_folder(path: Optional[str]) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "config.json")) and bool(
        glob.glob(os.path.join(path, "*.safetensors")) or glob.glob(os.path.join(path, "pytorch_model*.bin")))


def _is_engine_save(path: str) -> bool:
    from ..checkpoint.folder import has_checkpoint
    return has_checkpoint(path)


def check_sources(raw: Mapping) -> None:
    """Before any process group: a named checkpoint that is not there is one clear error."""
    src = raw.get("load_checkpoint") or ""
    if src and not os.path.exists(str(src)):
        raise _err("load_checkpoint", src, "does not exist", "point it at a HF folder, an engine.save folder or a "
                   "MindSpore .ckpt/.safetensors (file or rank_* folder), or leave it empty for random init")
    strategy = raw.get("src_strategy_path_or_dir") or ""
    if strategy and not os.path.exists(str(strategy)):
        raise _err("src_strategy_path_or_dir", strategy, "does not exist", "fix the path or leave it empty")


def build_model(raw: Mapping, run_yaml: str, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    src = str(raw.get("load_checkpoint") or "")
    pretrained = raw.get("pretrained_model_dir")
    hf_dir = src if _is_hf_folder(src) else (str(pretrained) if _is_hf_folder(pretrained) else None)
    if hf_dir:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=torch.float32)
        _load_mtp_layers(model, hf_dir, raw)
    else:
        from ..checkpoint.mindformers_model import model_from_yaml
        try:
            config = model_from_yaml(run_yaml).hf_config
        except ValueError as e:
            raise _err("model.model_config", None, str(e)) from None
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if src and not _is_hf_folder(src):
        weights = _weights(src, raw, run_yaml)
        n, depth = model.config.num_hidden_layers, _mtp_depth(raw)
        if depth:  # the checkpoint's MTP layers (models/mtp.py: layers N.. under HF names) are the run's
            from ..models import adapter_for
            from ..models.mtp import add_mtp_layers
            add_mtp_layers(model, depth, getattr(adapter_for(model), "make_mtp_layer", None))
        else:  # a MindFormers checkpoint holds them whether or not this run trains them
            weights = {k: v for k, v in weights.items() if not _past(k, n)}
        model.load_state_dict(weights, strict=True)
    return model.float()


def _past(name: str, n: int) -> bool:
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= n


def _mtp_depth(raw: Mapping) -> int:
    from ..config.mindformers import MODEL_ALIASES
    mc = (raw.get("model") or {}).get("model_config") or {}
    return next((int(mc[k]) for k in MODEL_ALIASES["mtp_depth"] if mc.get(k)), 0)


def _load_mtp_layers(model, hf_dir: str, raw: Mapping) -> None:
    """HF's loader skips layers past num_hidden_layers: a folder the importer wrote with MTP layers keeps them for a
    run that trains MTP (else the engine would start them from a seed)."""
    depth = _mtp_depth(raw)
    if not depth or not getattr(model.config, "num_nextn_predict_layers", 0):
        return
    from ..checkpoint.mindformers import read_mtp_layers
    from ..models import adapter_for
    from ..models.mtp import add_mtp_layers
    adapter = adapter_for(model)
    if not getattr(adapter, "mindformers_mtp", False):
        return
    add_mtp_layers(model, depth, getattr(adapter, "make_mtp_layer", None))
    missing = read_mtp_layers(hf_dir, model, adapter)
    if missing and len(missing) < sum(1 for n in model.state_dict() if _past(n, model.config.num_hidden_layers)):
        raise _err("load_checkpoint", hf_dir, f"holds part of the MTP layers (lacks {', '.join(missing[:4])})",
                   "point it at a complete HF folder (msparallel-ds import-mindspore writes them whole)")


def _weights(src: str, raw: Mapping, run_yaml: str) -> dict:
    if os.path.isdir(src) and _is_engine_save(src):  # weights only: resume_training restores the rest
        from ..checkpoint.folder import checkpoint_kind
        kind = checkpoint_kind(src)
        if kind == "sharded":
            from ..checkpoint.merged import read_weights
            return read_weights(src)
        if kind == "converted":
            raise _err("load_checkpoint", src, "is a convert-checkpoint folder (pre-sliced for one layout)",
                       "point load_checkpoint at the engine.save folder it came from, or an HF folder")
        from ..checkpoint.format import FILE, FORMAT, read_checkpoint_file
        ck = read_checkpoint_file(os.path.join(src, FILE), FORMAT)
        return {name: rec["fp32"] for name, rec in ck["params"].items()}
    from ..checkpoint.mindformers import mindformers_to_hf
    strategy = raw.get("src_strategy_path_or_dir") or None
    try:
        _, tensors, _, _ = mindformers_to_hf(src, run_yaml, strategy=strategy)
    except (ValueError, FileNotFoundError) as e:
        raise _err("load_checkpoint", src, f"could not be imported as a MindSpore checkpoint: {e}") from None
    return {k: v.float() for k, v in tensors.items()}
