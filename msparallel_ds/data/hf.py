"""HFDataLoader: HF `datasets` from local files, MindFormers' instruction handlers, tokenised with a local HF tokenizer.

Follows MindFormers 2.1 dataset/dataloader/hf_dataloader.py (the loader's keys other than its own go to
datasets.load_dataset; `handler` entries run in order: MindFormers' handler classes by name, else a datasets method
of that name) and dataset/handler/alpaca_handler.py (template, labels shifted by one, pad / truncate to seq_length,
+1 for legacy models). Nothing is fetched from a hub: local builders and folders only, tokenizers local_files_only.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping

import numpy as np

from ..config.errors import ConfigError, ConfigIssue
from .rows import Table

_KEY = "train_dataset.data_loader"
_OWN = {"type", "handler", "shuffle", "create_attention_mask", "create_compressed_eod_mask",
        "compressed_eod_mask_length", "use_broadcast_data", "packing", "adaptor_config", "dataset_dir",
        "column_names", "load_func", "streaming", "size", "dataset_state_dir", "save_step", "resume_step", "batch_size"}
_LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow"}

SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
          "The assistant gives helpful, detailed, and polite answers to the user's questions.")
WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
              "Write a response that appropriately completes the request.\n\n"
              "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:")
WITHOUT_INPUT = ("Below is an instruction that describes a task. "
                 "Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Response:")


def _err(key, value, rule, fix=""):
    return ConfigError(ConfigIssue(key, value, rule, fix))


def load_tokenizer(spec: Mapping | None, data: Mapping, key: str):
    """A local HF tokenizer from the handler's tokenizer.pretrained_model_dir or the YAML's pretrained_model_dir."""
    from transformers import AutoTokenizer
    spec = dict(spec or {})
    folder = spec.get("pretrained_model_dir") or data.get("pretrained_model_dir")
    if not folder or not os.path.isdir(str(folder)):
        raise _err(f"{key}.tokenizer.pretrained_model_dir", folder, "is not a local folder with a HF tokenizer",
                   "set pretrained_model_dir (top level or in the handler's tokenizer) to the model folder")
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    tok.padding_side = spec.get("padding_side", "right")
    return tok


class AlpacaInstruct:
    """MindFormers' AlpacaInstructDataHandler, the same text, labels and lengths."""

    def __init__(self, tokenizer, seq_length: int, padding: bool, legacy: bool, ignore_token_id: int = -100,
                 pad_token_id: int | None = None):
        self.tok, self.seq_length, self.padding, self.legacy = tokenizer, seq_length, padding, legacy
        self.ignore = ignore_token_id
        self.pad = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else (pad_token_id or 0)

    def __call__(self, example: Dict[str, Any]) -> Dict[str, np.ndarray]:
        user = (WITH_INPUT if example.get("input") else WITHOUT_INPUT).format_map(example)
        token = self.tok(f"{SYSTEM} ")["input_ids"]
        labels = [self.ignore] * len(token)
        for role, value in (("USER", user), ("ASSISTANT", example.get("output", ""))):
            ids = self.tok(f"{role}: {value} " if role == "USER" else f"{role}: {value}</s>")["input_ids"]
            token += ids
            labels += [self.ignore] * len(ids) if role == "USER" else ids
        labels = labels[1:] + [self.ignore]
        n = self.seq_length + (1 if self.legacy else 0)
        if self.padding and len(token) < n:
            token += [self.pad] * (n - len(token))
            labels += [self.ignore] * (n - len(labels))
        return {"input_ids": np.array(token[:n], dtype=np.int32), "labels": np.array(labels[:n], dtype=np.int32)}


def _load(loader: Mapping):
    import datasets
    load = {k: v for k, v in loader.items() if k not in _OWN}
    func = loader.get("load_func", "load_dataset")
    if func != "load_dataset":
        raise _err(f"{_KEY}.load_func", func, "is not supported here", "use load_dataset with local files")
    path = load.get("path")
    if path not in _LOCAL_BUILDERS and not (path and os.path.isdir(str(path))):
        raise _err(f"{_KEY}.path", path, f"must be a local builder ({', '.join(sorted(_LOCAL_BUILDERS))}) or a "
                   "local folder: nothing is downloaded from a hub", "save the data locally and point path at it")
    files = load.get("data_files")
    for f in ([files] if isinstance(files, str) else list(files or [])):
        if isinstance(f, str) and not os.path.exists(f):
            raise _err(f"{_KEY}.data_files", f, "does not exist", "fix the path")
    ds = datasets.load_dataset(**load)
    if load.get("split") is None and not isinstance(ds, datasets.Dataset):
        ds = ds["train"]
    return ds


def hf_table(section: Mapping, data: Mapping):
    loader = section["data_loader"]
    if loader.get("shuffle", False):
        raise _err(f"{_KEY}.shuffle", True, "is not reproduced here (MindSpore's GeneratorDataset sampler)",
                   "set it to False and shuffle the files beforehand")
    if loader.get("streaming"):
        raise _err(f"{_KEY}.streaming", True, "is not supported by this reader", "set it to False")
    ds = _load(loader)
    for i, h in enumerate(loader.get("handler") or []):
        key = f"{_KEY}.handler[{i}]"
        h = dict(h)
        kind = h.pop("type", None)
        if kind == "AlpacaInstructDataHandler":
            tok = load_tokenizer(h.get("tokenizer"), data, key)
            padding = bool(h.get("padding", True)) and not (loader.get("packing") or h.get("is_dynamic"))
            fn = AlpacaInstruct(tok, int(h["seq_length"]), padding, bool(data.get("use_legacy", True)),
                                int(h.get("ignore_token_id", -100)), h.get("pad_token_id"))
            ds = ds.map(fn, remove_columns=[c for c in ds.column_names if c not in ("input_ids", "labels")])
        elif kind == "PackingHandler":
            raise _err(f"{key}.type", kind, "is not implemented by this reader yet",
                       "pack offline into MindRecord or Megatron .bin/.idx, or drop the PackingHandler")
        elif kind and hasattr(ds, kind):  # a datasets method, as MindFormers allows (rename_column, select, ...)
            ds = getattr(ds, kind)(**h)
        else:
            raise _err(f"{key}.type", kind, "is neither a MindFormers handler known here nor a datasets method",
                       "use AlpacaInstructDataHandler or a datasets.Dataset method name")
    columns: List[str] = list(ds.column_names)
    wanted = section.get("input_columns")
    if wanted and all(c in columns for c in wanted):
        columns = list(wanted)
    elif wanted and loader.get("handler"):
        missing = [c for c in wanted if c not in columns]
        raise _err("train_dataset.input_columns", list(wanted), f"name {missing}, which the handlers do not make "
                   f"(they make {columns})", f"set input_columns to {columns}")
    ds = ds.with_format("numpy", columns=columns)
    n = len(ds)
    if n == 0:
        raise _err(_KEY, loader.get("data_files"), "holds no rows")
    ident = np.arange(n, dtype=np.int64)

    def get(i: int) -> Dict[str, np.ndarray]:
        row = ds[i]
        return {c: np.asarray(row[c]) for c in columns}
    return Table(n, get, lambda epoch, sharded: ident, columns, "HFDataLoader")
