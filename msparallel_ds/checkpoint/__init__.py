"""Checkpoints of parallel runs, all cut by the one shard spec (msparallel_ds.tensor_parallel.spec):

- format:      the layout-independent training checkpoint file (engine.save / engine.load), atomic writes, reads
- optim_state: the optimizer state it carries (Adam moments, Muon's momentum) and where ZeRO-1 keeps it
- reshard:     gather tp shards (and pp stages) into full tensors, cut full tensors for a tp rank
- zero:        save / load for engine.Engine (DeepSpeed ZeRO 0-2)
- zero_stage:  a sharded save's ZeRO 1/2 staging: a local snapshot, rebuilt per parameter in the writer thread
- pipeline:    save / load for the pipeline engine
- hf:          plain HF safetensors checkpoints out of / into a tp-parallel model (save_pretrained, from_pretrained)
- convert:     convert-checkpoint, pre-slicing a checkpoint for another layout in one process
- folder:      which checkpoint in a folder is current, the save lock, what a save supersedes
- sharded:     sharded save / load on torch.distributed.checkpoint (each rank its chunks; async saves)
- merged:      a merged weights-only HF safetensors folder out of a sharded checkpoint, in bounded files
- monitor:     CheckpointSaver, MindFormers' CheckpointMonitor semantics for the train runner

Modules depend one way (folder <- format, optim_state <- reshard, sharded, zero_stage <- zero, pipeline, hf;
format <- convert; sharded <- merged <- monitor). Names are re-exported lazily so `import msparallel_ds.checkpoint`
stays light (no torch.distributed, DeepSpeed or HF).
"""
from __future__ import annotations

import importlib

_LAZY = {
    "FILE": "format", "FORMAT": "format", "SHARDED_FORMAT": "format", "SHARDED_INDEX": "format",
    "atomic_save": "format", "check_names": "format", "read_checkpoint_file": "format", "read_for_layout": "format",
    "shard_file": "format",
    "fit": "reshard", "gather_full_state_dict": "reshard", "gather_pipeline_state_dict": "reshard",
    "gather_state_dict": "reshard", "merge_over_pp": "reshard",
    "load_checkpoint": "zero", "save_checkpoint": "zero",
    "load_pipeline_checkpoint": "pipeline", "save_pipeline_checkpoint": "pipeline",
    "build_on_meta": "hf", "clean_saved_config": "hf", "from_pretrained": "hf", "load_sharded_checkpoint": "hf",
    "save_pretrained": "hf", "zero3_gathered": "hf",
    "convert_checkpoint": "convert",
    "MANIFEST": "folder", "checkpoint_kind": "folder", "has_checkpoint": "folder",
    "load_sharded": "sharded", "open_sharded": "sharded", "save_sharded": "sharded", "wait_pending": "sharded",
    "export_merged": "merged", "CheckpointSaver": "monitor",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
