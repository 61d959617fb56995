"""A merged, weights-only HF folder (safetensors) out of a sharded checkpoint, in bounded chunks.

    export_merged("ckpt/step-00000100", "ckpt/step-00000100/hf")    # every rank calls (or one process alone)

MindFormers' integrated_save writes one merged checkpoint; here no rank ever holds the whole model: the fp32
weights are planned into files of at most `max_shard_bytes` (in the HF shard naming, model-0000i-of-0000N and
model.safetensors.index.json), rank r reads and writes files r, r + world, ... (each file's tensors read whole from
the DCP chunks, then freed), and global rank 0 writes the index and config.json. from_pretrained loads the folder.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["export_merged"]


def _plan(sizes: dict[str, tuple], max_bytes: int, elem: int) -> list[list[str]]:
    files, size = [[]], 0
    for name, shape in sizes.items():
        n = elem * torch.Size(shape).numel()
        if files[-1] and size + n > max_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += n
    return files


def export_merged(ckpt_dir: str, out_dir: str, *, max_shard_bytes: int = 2 << 30,
                  dtype: torch.dtype = torch.float32, group: Optional[object] = None) -> list[str]:
    """Write the weights of the sharded checkpoint in ckpt_dir as an HF safetensors folder out_dir; returns the
    files this rank wrote. Every rank of `group` calls (none: this process alone)."""
    from torch.distributed.checkpoint import FileSystemReader, load

    from .format import atomic_write
    from .sharded import read_manifest

    man = read_manifest(ckpt_dir)
    data = os.path.join(ckpt_dir, man["data"])
    md = FileSystemReader(data).read_metadata()
    sizes = {k[:-len("/fp32")]: tuple(m.size) for k, m in md.state_dict_metadata.items() if k.endswith("/fp32")}
    files = _plan(sizes, max_shard_bytes, torch.empty((), dtype=dtype).element_size())
    names = ["model.safetensors"] if len(files) == 1 else \
        [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    distributed = group is not None and dist.is_initialized()
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for i in range(rank, len(files), world):
        sd = {f"{n}/fp32": torch.empty(sizes[n], dtype=torch.float32) for n in files[i]}
        load(sd, storage_reader=FileSystemReader(data), no_dist=True)
        tensors = {n: sd[f"{n}/fp32"].to(dtype).contiguous() for n in files[i]}
        path = os.path.join(out_dir, names[i])
        atomic_write(path, lambda f, t=tensors: f.write(_safetensors_bytes(t)), suffix=".safetensors")
        written.append(path)
        del sd, tensors
    if distributed:
        dist.barrier(group=group)
    if rank == 0:
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(torch.Size(s).numel() for s in sizes.values()) *
                                  torch.empty((), dtype=dtype).element_size()},
                     "weight_map": {n: names[i] for i, part in enumerate(files) for n in part}}
            with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=1)
        if man.get("model_config"):
            config = {**man["model_config"], "torch_dtype": str(dtype).replace("torch.", "")}
            with open(os.path.join(out_dir, "config.json"), "w") as f:
                json.dump(config, f, indent=1)
    return written


def read_weights(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """The fp32 weights of the sharded checkpoint in ckpt_dir, whole, in this process (every chunk's crc32 checked
    first): a weights-only start (the runner's load_checkpoint pointing at an engine.save folder)."""
    from torch.distributed.checkpoint import FileSystemReader, load

    from .sharded import _verify, read_manifest

    man = read_manifest(ckpt_dir)
    data = os.path.join(ckpt_dir, man["data"])
    md = FileSystemReader(data).read_metadata()
    _verify(data, md, man.get("checksums") or {}, 0, 1, ckpt_dir)
    sd = {k: torch.empty(tuple(m.size), dtype=torch.float32) for k, m in md.state_dict_metadata.items()
          if k.endswith("/fp32")}
    load(sd, storage_reader=FileSystemReader(data), no_dist=True)
    return {k[:-len("/fp32")]: v for k, v in sd.items()}


def _safetensors_bytes(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata={"format": "pt"})
