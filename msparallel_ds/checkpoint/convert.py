"""Offline resharding: `msparallel-ds convert-checkpoint SRC DST --to-config NEW.yaml`.

engine.save writes one layout-independent file (full-size fp32 weights and Adam moments); engine.load slices it
for any layout, but every rank then reads the whole file. The converter does that slicing once, ahead of the run,
in this one process: the shard spec of NEW.yaml's layout is a pure function of the saved model config's TP plan
(its family adapter, tp, vocab parallel) and the checkpoint's parameter names, so no model is built and no process
is started. DST gets one file per (pp, tp) coordinate holding exactly the slices that coordinate's ranks load (dp
and cp peers hold the same slices; ZeRO partitions are cut by DeepSpeed's setters at load time) and an index;
engine.load(DST) under NEW.yaml reads only its own file, and refuses DST under a layout with another pp or tp,
naming the fix. DST is written under a temporary name and renamed when complete.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

from .format import (FILE, FORMAT, SHARDED_FORMAT, SHARDED_INDEX, atomic_save, checksums, read_checkpoint_file,
                     shard_file, verify_checksums)
from .paths import temp_dir_beside

__all__ = ["convert_checkpoint", "convert_to_sharded", "target_spec"]


def _adapter(model_config: dict[str, Any], need: bool, where: str = "the checkpoint"):
    """(HF config, family adapter) of the saved model; the adapter is None for an unknown family unless `need`."""
    from transformers import AutoConfig

    from ..models import adapter_for_config

    if not isinstance(model_config, dict) or not isinstance(model_config.get("model_type"), str):
        raise ValueError(f"{where}: model_config {str(model_config)[:120]} names no model_type (a HF config "
                         "dict is expected, as engine.save writes it); save the checkpoint again with msparallel_ds")
    kw = dict(model_config)
    try:
        hf_config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    except Exception as e:  # noqa: BLE001  HF's strict config classes raise several types; one line naming it
        last = str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
        raise ValueError(f"{where}: model_config does not make a {model_config['model_type']} HF config: "
                         f"{last}") from None
    try:
        return hf_config, adapter_for_config(hf_config)
    except ValueError:
        if need:
            raise
        return hf_config, None


def target_spec(hf_config, adapter, names, tp: int, vocab_parallel: bool):
    """The shard spec of the saved model under tp (vocab_parallel: the input and output embeddings split too), from its
    family adapter's TP plan; every parameter is replicated when tp == 1. A model that cannot be split over tp
    (heads or a split dim not divisible by tp) is a clear error here, before anything is written."""
    from ..tensor_parallel.spec import ShardSpec

    names = list(names)
    if tp == 1:
        return ShardSpec({})
    # sequence parallel moves activations, never parameters (and MoE families require it with tp > 1)
    plan = adapter.tp_plan(hf_config, tp, sequence_parallel=True, vocab_parallel=vocab_parallel)
    spec = ShardSpec.from_plan(plan, names)
    if not spec.split_names():
        raise ValueError(f"the TP plan for model_parallel={tp} matches no parameter of the checkpoint (names like "
                         f"{names[:3]}): it cannot be split over tp; convert for model_parallel: 1")
    return spec


def check_divisible(params: dict, spec, tp: int) -> None:
    from ..tensor_parallel.layers import divide

    for name in spec.split_names():
        dim = spec[name].dim
        for k, t in params[name].items():
            divide(t.shape[dim], tp, f"{name} ({k}) dim {dim}")


def convert_checkpoint(src: str, dst: str, config: Any, *, timeout: Optional[float] = None,
                       echo: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """Slice engine.save's checkpoint in `src` for the layout of `config` (YAML path, dict or ParallelConfig) into
    the new folder `dst`. Returns the index written to dst. `timeout` is accepted for callers of the former
    multi-process converter and ignored (nothing to wait for)."""
    from ..config import ParallelConfig, load_config
    from ..plan import make_plan

    cfg = config if isinstance(config, ParallelConfig) else load_config(config)
    plan = make_plan(cfg)
    from .folder import checkpoint_kind

    if checkpoint_kind(src) == "sharded":
        raise ValueError(f"{src} is a sharded checkpoint (engine.save(dir, sharded=True)): it loads under any layout "
                         "as it is (engine.load reshards), no conversion needed")
    ck = read_checkpoint_file(os.path.join(src, FILE), FORMAT)
    verify_checksums(ck, ck["params"], f"{src}/{FILE}")  # a corrupted source is an error, not a converted copy
    if not ck.get("model_config"):
        raise ValueError(f"{src}/{FILE} carries no model config (saved by an older msparallel_ds); resume it with "
                         "engine.load under the new layout instead")
    dst_path = Path(dst)
    if dst_path.exists() and any(dst_path.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty; convert-checkpoint writes a new folder")
    pp, tp = plan.mesh.pp, plan.mesh.tp
    if pp > 1:
        raise ValueError(f"parallel_config.pipeline_stage={pp}: convert-checkpoint prepares "
                         "pipeline_stage 1 layouts; a pipeline run loads the layout-independent checkpoint directly "
                         "(engine.load(SRC))")
    hf_config, adapter = _adapter(ck["model_config"], need=tp > 1, where=f"{src}/{FILE}")
    spec = target_spec(hf_config, adapter, ck["params"], tp, plan.vocab_parallel)
    check_divisible(ck["params"], spec, tp)
    # the HF model's parameter order (a pipeline checkpoint lists each rank's stages in turn), as the former
    # converter's meta model gave it, so converted files stay byte-identical
    order = adapter.parameter_order(ck["params"]) if adapter is not None else list(ck["params"])
    tmp = temp_dir_beside(dst)  # created exclusively: a link placed at a predictable name is never followed
    try:
        for rank in range(tp):
            params = {name: {k: spec.get(name).local(v, tp, rank).clone() for k, v in ck["params"][name].items()}
                      for name in order}
            atomic_save({"format": SHARDED_FORMAT, "params": params, "optimizer_step": ck["optimizer_step"],
                         "global_steps": ck["global_steps"], "lr_scheduler": ck["lr_scheduler"],
                         "model_config": ck["model_config"], "checksum": "crc32", "checksums": checksums(params)},
                        os.path.join(tmp, shard_file(0, rank)))
            del params
            if echo:
                echo(f"  wrote {shard_file(0, rank)}")
        index = {"format": SHARDED_FORMAT, "source": os.path.abspath(src),
                 "config": str(config) if isinstance(config, (str, os.PathLike)) else None,
                 "mesh": {"pp": pp, "tp": tp},
                 "files": sorted(f for f in os.listdir(tmp) if f.endswith(".pt"))}
        with open(os.path.join(tmp, SHARDED_INDEX), "w") as f:
            json.dump(index, f, indent=1)
        if dst_path.exists():
            dst_path.rmdir()  # empty (checked above)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index


def convert_to_sharded(src: str, dst: str) -> dict[str, Any]:
    """engine.save's single file (msp_universal.pt) in `src` -> the sharded format (checkpoint.sharded) in the new
    folder `dst`, in this one process: layout-independent too, and every rank of a later run reads only its chunks.
    Returns the manifest written."""
    from .folder import MANIFEST
    from .sharded import read_manifest, write_whole

    ck = read_checkpoint_file(os.path.join(src, FILE), FORMAT)
    verify_checksums(ck, ck["params"], f"{src}/{FILE}")
    dst_path = Path(dst)
    if dst_path.exists() and any(dst_path.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty; convert-checkpoint writes a new folder")
    tmp = f"{dst_path.as_posix().rstrip('/')}.tmp-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    try:
        progress = {k: ck[k] for k in ("optimizer_step", "global_steps", "lr_scheduler")}
        write_whole(ck["params"], progress, ck.get("model_config"), tmp)
        if dst_path.exists():
            dst_path.rmdir()
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    assert os.path.exists(os.path.join(dst, MANIFEST))
    return read_manifest(dst)
