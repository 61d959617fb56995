"""HF checkpoints in and out of a tensor-parallel model: gather to save, read only this rank's slices to load.

    save_pretrained(model, layout, "out/")                 # a plain HF checkpoint (AutoModel.from_pretrained loads it)
    model = from_pretrained("out/", layout, parallelize_fn=lambda m, lay: tp_parallelize(m, lay, vocab_parallel=True))

Parameter names are the HF model's (tp layers keep nn.Linear/nn.Embedding names), so checkpoint keys map 1:1.
Which tensor is split over tp, and along which dim, is the shard spec's (tensor_parallel.spec; by default read back
from the parallelized model's parameters). Loading builds the model on the meta device, parallelizes it, then reads
each rank's slice with safetensors' get_slice (Shard.index), so no rank materializes the full model.
"""
from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack, nullcontext
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..tensor_parallel.spec import Shard, ShardSpec
from .reshard import gather_full_state_dict

if TYPE_CHECKING:
    from ..distributed.layout import ParallelLayout

__all__ = ["build_on_meta", "check_checkpoint_dir", "clean_saved_config", "from_pretrained", "load_sharded_checkpoint",
           "save_pretrained", "zero3_gathered"]

_SAFE_FILE, _SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
_BIN_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_ATTN_KEYS = ("attn_implementation", "_attn_implementation", "_attn_implementation_internal")


def zero3_gathered(model: nn.Module, zero_stage: int):
    """ZeRO-3 keeps only a partition of each parameter: a context that gathers them (a no-op below stage 3)."""
    if zero_stage != 3:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)


# ---------------------------------------------------------------------------------------------- save
def clean_saved_config(save_dir: str, total_parameters: int) -> None:
    """The saved config is the architecture's own: a plain process cannot load a custom attention name (e.g. our
    context-parallel "msparallel_cp"). HF's index counts this rank's shards as total_parameters: fix it."""
    path = os.path.join(save_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    if any(k in config for k in _ATTN_KEYS):
        with open(path, "w") as f:
            f.write(json.dumps({k: v for k, v in config.items() if k not in _ATTN_KEYS}, indent=2, sort_keys=True)
                    + "\n")
    index = os.path.join(save_dir, _SAFE_INDEX)
    if os.path.exists(index):
        with open(index) as f:
            data = json.load(f)
        data["metadata"]["total_parameters"] = total_parameters
        with open(index, "w") as f:
            f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_pretrained(model: nn.Module, layout: ParallelLayout, save_dir: str | os.PathLike, *,
                    spec: Optional[ShardSpec] = None, **hf_kwargs) -> None:
    """Write a plain HF checkpoint (safetensors, config, generation config) of a tp-parallel model; call on every
    rank. Global rank 0 writes with HF's own model.save_pretrained; every rank returns once the files exist."""
    full = gather_full_state_dict(model, layout, spec=spec)
    from ..pet import lora_applied, merged_state_dict

    if full is not None and lora_applied(model):  # pet_config LoRA: the HF model with the adapters merged in
        full = merged_state_dict(model, full)
    if layout.global_rank == 0:
        save_dir = os.fspath(save_dir)
        total = sum(t.numel() for t in {id(t): t for t in full.values()}.values())  # HF empties `full` as it writes
        model.save_pretrained(save_dir, state_dict=full, is_main_process=True, **hf_kwargs)
        clean_saved_config(save_dir, total)
    dist.barrier()


# ---------------------------------------------------------------------------------------------- load
def _weight_files(checkpoint_dir: str) -> dict[str, str]:
    """checkpoint key -> safetensors file path."""
    index, single = os.path.join(checkpoint_dir, _SAFE_INDEX), os.path.join(checkpoint_dir, _SAFE_FILE)
    if os.path.exists(index):
        return _index_files(index, checkpoint_dir)
    if os.path.exists(single):
        from safetensors import safe_open

        with safe_open(single, "pt") as f:
            return dict.fromkeys(f.keys(), single)
    if any(os.path.exists(os.path.join(checkpoint_dir, b)) for b in _BIN_FILES):
        raise ValueError(f"{checkpoint_dir} holds a .bin (pickle) checkpoint; only safetensors can be read by slice. "
                         f"Convert it once: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir)")
    raise FileNotFoundError(f"no {_SAFE_FILE} or {_SAFE_INDEX} in {checkpoint_dir}")


def _index_files(index: str, checkpoint_dir: str) -> dict[str, str]:
    """An HF index's weight_map, every file resolved inside checkpoint_dir (an entry outside it is an error)."""
    from .paths import contained

    try:
        with open(index, encoding="utf-8") as f:
            wmap = json.load(f).get("weight_map")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(wmap, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
        raise ValueError(f"{index}: not a safetensors index (expected {{'weight_map': {{name: file}}}})")
    return {k: contained(checkpoint_dir, v, index) for k, v in wmap.items()}


def _default_device(layout: ParallelLayout) -> torch.device:
    if layout.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(layout.device_type, int(os.environ.get("LOCAL_RANK", "0")))


def _read(handle, key: str, local_shape, shard: Shard, layout: ParallelLayout) -> Tensor:
    """This rank's part of checkpoint tensor `key` for a parameter/buffer of `local_shape`, shape-checked."""
    sl = handle.get_slice(key)
    shape, local = tuple(sl.get_shape()), tuple(local_shape)
    tp, tp_rank = layout.size(shard.group), layout.rank(shard.group)  # the shard's group: tp, or ep for experts
    full = shard.full_shape(local, tp)
    if not shard.is_split:
        if shape != local:
            raise ValueError(f"checkpoint tensor {key!r} has shape {shape} but the model expects {local} "
                             f"(replicated on every {shard.group} rank)")
        return handle.get_tensor(key)
    if shape != full:
        raise ValueError(f"checkpoint tensor {key!r} has shape {shape} but this {shard.group} rank's shard {local} "
                         f"(dim {shard.dim} split over {shard.group}={tp}) needs a full shape of {full}")
    blocks = [sl[index] for index in shard.indices(local, tp, tp_rank)]  # one per fused block (Shard.parts)
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, shard.dim)


class _OriginalFormat:
    """HF's original (hub) checkpoint names for a model family whose modules fuse them (MoE experts): the adapter
    says which keys make up a fused tensor; this rank reads only its own experts' keys."""

    def __init__(self, model: nn.Module, adapter):
        self.config, self.adapter = model.config, adapter

    def alias(self, name: str, files) -> Optional[str]:
        key = self.adapter.checkpoint_alias(name, self.config)
        return key if key in files else None

    def experts(self, name: str, files, handles, spec: ShardSpec, layout: ParallelLayout):
        """(this rank's part of fused expert tensor `name`, every expert's keys), or None if the checkpoint lacks
        any of them; only this rank's experts are read."""
        total = self.adapter.num_experts(self.config)
        shard = spec.get(name)
        n = layout.size(shard.group) if shard.is_split else 1
        first = (layout.rank(shard.group) if shard.is_split else 0) * (total // n)
        sources = self.adapter.checkpoint_sources(name, self.config, range(total))
        if not sources or not all(k in files for keys in sources for k in keys):
            return None
        local = sources[first:first + total // n]
        stacked = torch.stack([torch.cat([handles[files[k]].get_tensor(k) for k in keys]) for keys in local])
        return stacked, {k for keys in sources for k in keys}


def _original_format(model: nn.Module) -> Optional[_OriginalFormat]:
    from ..models import adapter_for

    try:
        adapter = adapter_for(model)
    except ValueError:
        return None
    return _OriginalFormat(model, adapter) if hasattr(adapter, "checkpoint_sources") else None


def _checked(data: Tensor, name: str, local_shape) -> Tensor:
    if tuple(data.shape) != tuple(local_shape):
        raise ValueError(f"checkpoint tensors for {name!r} assemble to shape {tuple(data.shape)} but the model expects "
                         f"{tuple(local_shape)} on this rank")
    return data


def _new_param(old: nn.Parameter, data: Tensor) -> nn.Parameter:
    """A real Parameter takes the data in place (same object: optimizers and hooks keep it). A meta one cannot
    (set_data rejects meta -> real), so a new Parameter carries over what tp_parallelize put on the old one:
    Megatron attributes, requires_grad, and grad hooks (replicated_with_grad_allreduce's all-reduce)."""
    if not old.is_meta:
        old.data = data
        return old
    new = nn.Parameter(data, requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)
    if old._backward_hooks:
        new._backward_hooks = old._backward_hooks
    return new


def _set_tensor(model: nn.Module, name: str, value: Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    (module._parameters if attr in module._parameters else module._buffers)[attr] = value


def _named_tensors(model: nn.Module) -> tuple[dict[int, list[str]], dict[int, Tensor], set[str]]:
    """Parameters and persistent buffers grouped by identity (tied names together), and non-persistent names."""
    names, tensors, transient = {}, {}, set()
    for mod_name, module in model.named_modules(remove_duplicate=False):
        prefix = mod_name + "." if mod_name else ""
        items = list(module._parameters.items()) + [(n, b) for n, b in module._buffers.items()
                                                     if n not in module._non_persistent_buffers_set]
        transient.update(prefix + n for n in module._non_persistent_buffers_set)
        for attr, t in items:
            if t is not None:
                names.setdefault(id(t), []).append(prefix + attr)
                tensors[id(t)] = t
    return names, tensors, transient


def _tie_output_embedding(model: nn.Module, spec: ShardSpec, missing: list[str]) -> list[str]:
    """A checkpoint of a tied model has no output embedding weight: point the output embedding at the input's
    Parameter."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    config = getattr(model, "config", None)
    if out is None or inp is None or not getattr(config, "tie_word_embeddings", False):
        return missing
    module_names = {id(m): n for n, m in model.named_modules()}
    key, in_key = f"{module_names.get(id(out))}.weight", f"{module_names.get(id(inp))}.weight"
    if key in missing and inp.weight.shape == out.weight.shape and spec.get(key).dim == spec.get(in_key).dim:
        out.weight = inp.weight
        return [k for k in missing if k != key]
    return missing


def _rebuild_rotary(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers are in no checkpoint; on meta they are recomputed: HF rotary embeddings derive
    inv_freq / original_inv_freq from the config, so a fresh module (built on CPU, fp32 as HF keeps them) supplies
    them. Other modules' meta buffers are left for the final check to name."""
    for module in model.modules():
        meta = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if meta and "Rotary" in type(module).__name__ and hasattr(module, "config"):
            with torch.device("cpu"):
                fresh = type(module)(module.config)
            for n in meta:
                if fresh._buffers.get(n) is not None:
                    module._buffers[n] = fresh._buffers[n].to(device)


def load_sharded_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike, layout: ParallelLayout, *,
                            spec: Optional[ShardSpec] = None, strict: bool = True, dtype: torch.dtype | None = None,
                            device=None) -> nn.Module:
    """Fill a (tp-parallelized) model, on meta or real, from a HF safetensors checkpoint directory: each split
    tensor reads only this rank's slice (spec: default read back from the model's parameters). dtype: cast floating
    tensors (default: keep the checkpoint's). device: default cpu, or <device_type>:LOCAL_RANK for an accelerator
    layout. strict: every parameter/persistent buffer must be in the checkpoint and every checkpoint key in the
    model. Returns model."""
    from safetensors import safe_open

    checkpoint_dir = os.fspath(checkpoint_dir)
    device = _default_device(layout) if device is None else torch.device(device)
    spec = ShardSpec.of_module(model) if spec is None else spec  # before the loaded Parameters replace the meta ones
    files = _weight_files(checkpoint_dir)
    names, tensors, transient = _named_tensors(model)
    missing, consumed = [], set()
    original = _original_format(model)
    with ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(path, "pt")) for path in sorted(set(files.values()))}
        for ident, tensor_names in names.items():
            old = tensors[ident]
            key = next((n for n in tensor_names if n in files), None)
            if key is None and original is not None:
                key = original.alias(tensor_names[0], files)
            if key is None:
                data = original.experts(tensor_names[0], files, handles, spec, layout) if original else None
                if data is None:
                    missing.extend(tensor_names)
                    continue
                consumed.update(data[1])
                data = _checked(data[0], tensor_names[0], old.shape)
            else:
                consumed.add(key)
                shard = spec.get(key if key in tensor_names else tensor_names[0])  # an alias has the model's name
                data = _read(handles[files[key]], key, old.shape, shard, layout)
            # safetensors' tensors are views of the mmapped file (storage = the whole tensor): copy out the shard
            data = data.to(device=device, dtype=dtype if dtype is not None and data.is_floating_point() else None,
                           memory_format=torch.contiguous_format, copy=True)
            new = _new_param(old, data) if isinstance(old, nn.Parameter) else data
            for n in tensor_names:  # every tied name gets the same new tensor
                _set_tensor(model, n, new)
    missing = _tie_output_embedding(model, spec, missing)
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    known = {n for group in names.values() for n in group} | transient | consumed
    unexpected = [k for k in files if k not in known and not any(p.search(k) for p in ignore)]
    if strict and (missing or unexpected):
        raise ValueError(f"checkpoint {checkpoint_dir} does not match the model: missing keys {missing} (the model's "
                         f"parameter/buffer names), unexpected keys {unexpected}; pass strict=False to allow it")
    _rebuild_rotary(model, device)
    on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if on_meta:
        raise RuntimeError(f"after loading {checkpoint_dir}, these tensors are still on the meta device (in no "
                           f"checkpoint and not recomputable): {on_meta}")
    return model.to(device)


def build_on_meta(config, model_cls=None) -> nn.Module:
    """The model of a HF config on the meta device: shapes only, no rank allocates (or initializes) the full model.
    model_cls: a HF model class (default AutoModelForCausalLM)."""
    from transformers import AutoModelForCausalLM

    model_cls = model_cls or AutoModelForCausalLM
    with torch.device("meta"):
        return model_cls.from_config(config) if hasattr(model_cls, "from_config") else model_cls._from_config(config)


def check_checkpoint_dir(checkpoint_dir: str | os.PathLike) -> str:
    """The path as a str when it is a local HF checkpoint folder (config.json inside), else a clear error: a Hub
    repo id is not downloaded here, and HF's own message for a missing path is about repo id characters."""
    path = os.fspath(checkpoint_dir)
    if not os.path.isdir(path):
        what = "a file, not a folder" if os.path.exists(path) else "nothing there"
        raise FileNotFoundError(
            f"no checkpoint at {path} ({what}): from_pretrained reads a local folder written by save_pretrained "
            f"(engine.save_pretrained(dir) or model.save_pretrained(dir)); for a Hub model download it first, e.g. "
            f"huggingface_hub.snapshot_download(repo_id, local_dir=dir)")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"no checkpoint at {path}: the folder has no config.json (write it with "
                                f"save_pretrained, or point at the folder that holds config.json and the "
                                f"*.safetensors files)")
    return path


def from_pretrained(checkpoint_dir: str | os.PathLike, layout: ParallelLayout, *, parallelize_fn,
                    dtype: torch.dtype | None = None,
                    device=None, model_cls=None, strict: bool = True, **config_overrides) -> nn.Module:
    """Build the model of a HF checkpoint directory on the meta device, parallelize it with
    parallelize_fn(model, layout) (None: keep it unsharded), then load this rank's shards; eval mode, like HF.
    config_overrides go to AutoConfig.from_pretrained (e.g. attn_implementation="eager")."""
    from transformers import AutoConfig, GenerationConfig

    checkpoint_dir = check_checkpoint_dir(checkpoint_dir)
    config = AutoConfig.from_pretrained(checkpoint_dir, **config_overrides)
    model = build_on_meta(config, model_cls)
    if parallelize_fn is not None:
        model = parallelize_fn(model, layout)
    load_sharded_checkpoint(model, checkpoint_dir, layout, strict=strict, dtype=dtype, device=device)
    if os.path.exists(os.path.join(checkpoint_dir, "generation_config.json")) and hasattr(model, "generation_config"):
        model.generation_config = GenerationConfig.from_pretrained(checkpoint_dir)
    return model.eval()
