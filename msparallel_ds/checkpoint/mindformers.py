"""MindSpore / MindFormers checkpoints in and out, without MindSpore installed.

    msparallel-ds import-mindspore SRC DST --config RUN.yaml [--strategy S] [--to-layout NEW.yaml]
    msparallel-ds export-mindspore HF_DIR OUT.ckpt --config RUN.yaml [--format safetensors]

Import reads SRC (a merged .ckpt, .safetensors or index, or MindFormers' per-rank `rank_*/` folders merged by the
strategy file: checkpoint/mindspore_files), maps MindFormers names and fused layouts to the HF model of RUN.yaml's
model_config (the family's weight map, checkpoint/weight_map.py), checks every name and shape against that model
built on the meta device, and only then writes: a HF folder (config.json + safetensors) that
AutoModelForCausalLM.from_pretrained loads, or with --to-layout our engine.load checkpoint (weights, fresh optimizer
state) pre-sliced for NEW.yaml's layout. Export is the inverse map, so export -> import gives the same tensors.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .mindformers_model import MindFormersModel, model_from_yaml
from .paths import set_user_mode, temp_dir_beside
from .weight_map import MappingError, to_hf, to_mf

__all__ = ["export_mindspore", "import_mindspore", "mindformers_to_hf", "read_mtp_layers"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _meta_model(model: MindFormersModel):
    """The HF model on the meta device (no memory): its parameters are what a checkpoint must hold (a tied head is
    the embedding: listed once), and the import assigns the checkpoint's tensors into it to save."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(model.hf_config)
    except (AssertionError, ValueError, RuntimeError, TypeError) as e:  # e.g. a pad_token_id past the vocab
        raise ValueError(f"the YAML's model.model_config does not build a {model.hf_config.model_type} model: "
                         f"{e}") from None
    _add_mtp(meta, model)
    return meta


def _mtp_depth(model: MindFormersModel) -> int:
    return int(getattr(model.hf_config, "num_nextn_predict_layers", 0) or 0) if model.adapter.mindformers_mtp else 0


def _add_mtp(hf_model, model: MindFormersModel) -> None:
    """The MTP layers a MindFormers checkpoint of this family holds (models/mtp.py: HF layers N..N+D-1)."""
    from ..models.mtp import add_mtp_layers

    depth = _mtp_depth(model)
    if depth:
        add_mtp_layers(hf_model, depth, getattr(model.adapter, "make_mtp_layer", None))  # a family's own


def _weights(hf_model) -> dict[str, Tensor]:
    """Parameters and persistent buffers (e.g. DeepSeek-V3's router e_score_correction_bias): what a checkpoint
    holds."""
    keep = set(hf_model.state_dict())
    out = dict(hf_model.named_parameters())
    out.update({n: b for n, b in hf_model.named_buffers() if n in keep})
    return out


def _mindformers_shapes(model: MindFormersModel, expected: dict[str, Tensor]) -> dict[str, tuple]:
    """The full shape of every MindFormers name the model can have (fused and split forms), mapped on meta."""
    shapes = {}
    for fused in (True, False):
        shapes.update({n: tuple(t.shape) for n, t in to_mf(model.ops, expected, model.hf_config, fused=fused).items()})
    return shapes


def _check(hf: dict[str, Tensor], expected: dict, origin: dict[str, list[str]], uncovered: set[str],
           what: str) -> None:
    problems = [f"missing {n} {tuple(s)}" for n, s in expected.items() if n not in hf]
    problems += [f"{', '.join(origin.get(n, [n]))} -> {n}: the model has no such parameter" for n in hf
                 if n not in expected]
    for n, t in hf.items():
        if n in expected and tuple(t.shape) != tuple(expected[n]):
            srcs = origin.get(n, [n])
            sliced = [s for s in srcs if s in uncovered]
            why = (f"; {', '.join(sliced)} came from per-rank slices but the strategy file covers no layout for it "
                   "(pass the strategy file of the run that saved it with --strategy)") if sliced else ""
            problems.append(f"{', '.join(srcs)} -> {n}: shape {tuple(t.shape)}, the YAML's model needs "
                            f"{tuple(expected[n])}{why}")
    if problems:
        raise MappingError(f"{what}: " + "; ".join(problems) + ". Nothing was written")


def mindformers_to_hf(src: str, config: str, *, strategy: Optional[str] = None,
                      legacy_fused_layout: str = "interleaved") -> tuple[MindFormersModel, dict[str, Tensor], Any, Any]:
    """(model, HF-named full tensors in the model's order, the read report, the HF model on meta), every name and
    shape checked."""
    from .mindspore_files import read_mindspore_weights

    model = model_from_yaml(config, legacy_fused_layout=legacy_fused_layout)
    meta = _meta_model(model)
    expected = _weights(meta)
    weights = read_mindspore_weights(src, strategy=strategy, full_shapes=_mindformers_shapes(model, expected))
    origin: dict[str, list[str]] = {}
    hf = to_hf(model.ops, weights.tensors, model.hf_config, origin=origin)
    _check(hf, {n: t.shape for n, t in expected.items()}, origin, set(weights.uncovered), f"{src} under {config}")
    return model, {n: hf[n] for n in expected}, weights, meta


def _cast(tensors: dict[str, Tensor], dtype: Optional[str]) -> dict[str, Tensor]:
    if dtype is None:
        return tensors
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype} must be one of {', '.join(_DTYPES)}")
    return {n: t.to(_DTYPES[dtype]) if t.is_floating_point() else t for n, t in tensors.items()}


def _check_fresh(dst: str) -> None:
    path = Path(dst)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{dst} exists and is not an empty folder; import-mindspore writes a new folder")


def _publish(tmp: str, dst: str) -> None:
    if Path(dst).exists():
        Path(dst).rmdir()  # empty (checked before anything was written)
    os.replace(tmp, dst)


def _write_hf(tmp: str, meta, tensors: dict[str, Tensor]) -> None:
    """HF's own save_pretrained of the meta model with these tensors assigned, so the folder is in the format
    transformers writes (e.g. one matrix per expert for MoE models)."""
    meta.load_state_dict(tensors, strict=True, assign=True)
    meta.tie_weights()
    meta.save_pretrained(tmp)


def _write_layout(tmp: str, model: MindFormersModel, tensors: dict[str, Tensor], layout_yaml: str, echo) -> None:
    """engine.save's record of these weights (fp32 masters, no Adam moments: a fresh optimizer), sliced for
    layout_yaml's (pp 1, tp) coordinates by convert-checkpoint, or whole for a pipeline layout."""
    from ..config import load_config
    from ..plan import make_plan
    from .convert import check_divisible, convert_checkpoint, target_spec
    from .format import FILE, FORMAT, atomic_save, checksums

    plan = make_plan(load_config(layout_yaml))
    params = {n: {"fp32": t.float().contiguous()} for n, t in tensors.items()}
    record = {"format": FORMAT, "params": params, "optimizer_step": 0.0, "global_steps": 0, "lr_scheduler": None,
              "model_config": model.hf_config.to_dict(), "checksum": "crc32", "checksums": checksums(params)}
    if plan.mesh.pp > 1:  # engine.load slices the layout-independent file itself: check the tp split here
        tp = plan.mesh.tp
        check_divisible(params, target_spec(model.hf_config, model.adapter, params, tp, plan.vocab_parallel), tp)
        atomic_save(record, os.path.join(tmp, FILE))
        return
    whole = temp_dir_beside(f"{tmp}-whole")
    try:
        atomic_save(record, os.path.join(whole, FILE))
        convert_checkpoint(whole, tmp, layout_yaml, echo=echo)  # tmp is empty: convert replaces it
    finally:
        shutil.rmtree(whole, ignore_errors=True)


def import_mindspore(src: str, dst: str, config: str, *, strategy: Optional[str] = None,
                     to_layout: Optional[str] = None, legacy_fused_layout: str = "interleaved",
                     dtype: Optional[str] = None, echo: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """Import SRC (see the module docstring) into the new folder DST. Returns a report (files read, names dropped,
    tensors written)."""
    _check_fresh(dst)
    model, tensors, weights, meta = mindformers_to_hf(src, config, strategy=strategy,
                                                      legacy_fused_layout=legacy_fused_layout)
    tensors = _cast(tensors, dtype)
    tmp = temp_dir_beside(dst)  # created exclusively: a link placed at a predictable name is never followed
    try:
        if to_layout:
            _write_layout(tmp, model, tensors, to_layout, echo)
        else:
            _write_hf(tmp, meta, tensors)
        _publish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"files": list(weights.files), "dropped": dict(weights.dropped), "tensors": len(tensors),
            "parameters": sum(t.numel() for t in tensors.values()), "legacy": model.legacy,
            "model_type": model.hf_config.model_type, "to_layout": to_layout}


def _read_hf_dir(src: str, model: MindFormersModel) -> tuple[dict, dict[str, Tensor]]:
    """(config.json, the model's parameters by name): transformers reads the folder, so every format it writes
    (one matrix per expert, sharded files) comes out under the model's own parameter names."""
    from transformers import AutoModelForCausalLM

    cfg_path = Path(src) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{src}: no config.json (export-mindspore reads a HF folder: save_pretrained's)")
    try:
        hf = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    except pickle.UnpicklingError as e:  # a .bin with objects other than tensors: transformers reads weights-only
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "Unsupported global" in ln), lines[0] if lines else "")
        raise ValueError(f"{src}: its pytorch_model.bin holds objects other than tensors ({why}); it is read "
                         "weights-only and refused. Save the model with save_pretrained (safetensors)") from None
    if _mtp_depth(model):  # HF's loader skips layers past num_hidden_layers: the MTP layers are read here
        _add_mtp(hf, model)
        _read_mtp(src, hf, model)
    return json.loads(cfg_path.read_text()), {n: p.detach() for n, p in _weights(hf).items()}


def _read_mtp(src: str, hf, model: MindFormersModel) -> None:
    missing = read_mtp_layers(src, hf, model.adapter)
    if missing:
        raise MappingError(f"{src}: the YAML's model has {_mtp_depth(model)} MTP layer(s) (num_nextn_predict_layers) "
                           f"but the folder lacks {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")


def read_mtp_layers(src: str, hf, adapter) -> list[str]:
    """Fill a HF model's MTP layers (layers past num_hidden_layers, models/mtp.py) from the HF folder SRC, which
    HF's own loader skips, fusing one-matrix-per-expert keys as HF's loader does (adapter.checkpoint_sources).
    Returns the names SRC lacks (nothing is loaded then)."""
    from safetensors import safe_open

    handles = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            handles.update({k: f for k in h.keys()})
    first = hf.config.num_hidden_layers
    names = [n for n in _weights(hf) if n.startswith("model.layers.") and int(n.split(".")[2]) >= first]
    experts = range(adapter.num_experts(hf.config))
    state, missing = {}, []
    for name in names:
        groups = [[name]] if name in handles else adapter.checkpoint_sources(name, hf.config, experts)
        if not groups or any(k not in handles for g in groups for k in g):
            missing.append(name)
            continue
        rows = [torch.cat([_read_key(handles[k], k) for k in g]) for g in groups]
        state[name] = rows[0] if groups == [[name]] else torch.stack(rows)
    if not missing:
        hf.load_state_dict(state, strict=False)
    return missing


def _read_key(path, key: str) -> Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as h:
        return h.get_tensor(key)


def export_mindspore(src: str, dst: str, config: str, *, fmt: str = "ckpt", dtype: Optional[str] = None,
                     legacy_fused_layout: str = "interleaved") -> dict[str, Any]:
    """HF folder SRC -> one merged MindSpore checkpoint DST (.ckpt or .safetensors) under the MindFormers names of
    config's model (legacy or mcore; fused as the YAML's model fuses them)."""
    from .format import ARCH_KEYS
    from .mindspore_files import write_ckpt

    if fmt not in ("ckpt", "safetensors"):
        raise ValueError(f"--format {fmt} must be ckpt or safetensors")
    if Path(dst).exists():
        raise FileExistsError(f"{dst} exists; export-mindspore writes a new file")
    model = model_from_yaml(config, legacy_fused_layout=legacy_fused_layout)
    saved, tensors = _read_hf_dir(src, model)
    mine = model.hf_config.to_dict()
    for key in ARCH_KEYS:
        if saved.get(key) is not None and mine.get(key) is not None and saved[key] != mine[key]:
            raise ValueError(f"{src} is another model than {config} describes: {key}={saved[key]!r} in its "
                             f"config.json, {mine[key]!r} from the YAML; export with the YAML of this model")
    _check(tensors, {n: p.shape for n, p in _weights(_meta_model(model)).items()}, {}, set(), f"{src}")
    mf = to_mf(model.ops, _cast(tensors, dtype), model.hf_config, fused=model.qkv_concat)
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    if fmt == "ckpt":
        write_ckpt(dst, mf)
    else:
        from safetensors.torch import save_file

        fd, tmp = tempfile.mkstemp(prefix=f".{Path(dst).name}.tmp-", dir=Path(dst).parent)  # exclusive, no links
        os.close(fd)
        try:
            save_file({n: t.contiguous() for n, t in mf.items()}, tmp, metadata={"format": "ms"})
            set_user_mode(tmp)
            os.replace(tmp, dst)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return {"tensors": len(mf), "parameters": sum(t.numel() for t in mf.values()), "names": list(mf)}
