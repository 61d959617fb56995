"""BlendedMegatronDatasetDataLoader: Megatron .bin/.idx through Megatron-Core's own GPTDataset and BlendedDataset.

MindFormers 2.x ships a copy of Megatron-Core's dataset code; the samples agree (tests/fixtures/gptdataset, made by
MindFormers' copy) once two MindFormers rules are kept: a blend asks each dataset for ceil(size * weight * 1.005)
samples (Megatron-Core rounds size * weight up first), and the blended dataset is as long as those requests together
(Megatron-Core cuts it to `size`). Megatron-Core is imported only here (its package import is slow).
"""
from __future__ import annotations

import math
import os
from typing import Mapping

import numpy as np

from ..config.errors import ConfigError, ConfigIssue
from .rows import Table

_KEY = "train_dataset.data_loader"
_MF_COLUMNS = ("tokens", "labels", "loss_mask", "position_ids")


class _EodPad:
    """What Megatron-Core's GPTDataset asks of a tokenizer: eod, pad, an identity for its cache description."""

    vocab_size = None

    def __init__(self, eod: int, pad: int):
        self.eod, self.pad = eod, pad
        self.unique_identifiers = {"class": "msparallel_ds", "eod": eod, "pad": pad}


def _err(key, value, rule, fix=""):
    return ConfigError(ConfigIssue(key, value, rule, fix))


def _megatron():
    try:
        from megatron.core.datasets.blended_dataset import BlendedDataset
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        from megatron.core.datasets.utils import get_blend_from_list, normalize
    except ImportError as e:
        raise _err(f"{_KEY}.type", "BlendedMegatronDatasetDataLoader", f"needs megatron-core ({e})",
                   "pip install megatron-core") from None
    return BlendedDataset, BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig, get_blend_from_list, normalize


def build_gpt_dataset(section: Mapping):
    """The train split as MindFormers builds it: a Megatron-Core dataset with __len__ and __getitem__ -> dict."""
    loader = section["data_loader"]
    if loader.get("datasets_type", "GPTDataset") != "GPTDataset":
        raise _err(f"{_KEY}.datasets_type", loader.get("datasets_type"), "is not supported (MindFormers has only "
                   "GPTDataset)", "use GPTDataset")
    conf = loader.get("config") or {}
    sizes = loader.get("sizes")
    if not isinstance(sizes, (list, tuple)) or len(sizes) != 3 or not sizes[0]:
        raise _err(f"{_KEY}.sizes", sizes, "must be [train, test, eval] sample counts with train > 0",
                   "e.g. [1000, 0, 0]")
    seq = conf.get("seq_length")
    if not isinstance(seq, int) or seq <= 0:
        raise _err(f"{_KEY}.config.seq_length", seq, "must be a positive int")
    path = conf.get("data_path")
    if not isinstance(path, (list, tuple)) or not path:
        raise _err(f"{_KEY}.config.data_path", path, "must be a list: ['weight', prefix, ...] or [prefix]",
                   "e.g. ['1', /data/wiki_text_document]")
    prefixes = [p for i, p in enumerate(path) if len(path) == 1 or i % 2 == 1]
    for p in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(str(p) + ext):
                raise _err(f"{_KEY}.config.data_path", str(p), f"has no {ext} file ({p}{ext})",
                           "give the prefix of a Megatron .bin/.idx pair (without the suffix)")
    if loader.get("shuffle", False):
        raise _err(f"{_KEY}.shuffle", True, "is not reproduced here (GPTDataset already shuffles with config.seed)",
                   "set it to False, as MindFormers' pretrain configs do")
    Blended, Builder, GPT, GPTConfig, get_blend_from_list, normalize = _megatron()
    cfg = GPTConfig(
        random_seed=int(conf.get("seed", 1234)), sequence_length=seq, blend=get_blend_from_list([str(p) for p in path]),
        split=conf.get("split", "1, 0, 0"), path_to_cache=None, mmap_bin_files=conf.get("mmap_bin_files", True),
        reset_position_ids=bool(conf.get("reset_position_ids", False)),
        reset_attention_mask=bool(conf.get("reset_attention_mask", False)),
        eod_mask_loss=bool(conf.get("eod_mask_loss", False)),
        create_attention_mask=bool(conf.get("create_attention_mask", True)),
        add_extra_token_to_sequence=bool(conf.get("add_extra_token_to_sequence", True)),
        tokenizer=_EodPad(int(conf.get("eod", -1)), int(conf.get("pad", -1))), mid_level_dataset_surplus=0.005)
    sizes = [int(s) if s is not None else None for s in sizes]
    builder = Builder(GPT, sizes, lambda: True, cfg)
    prefixes, weights = cfg.blend
    if weights is None:  # one unweighted prefix: the same in both
        return builder.build()[0], cfg
    weights = normalize(weights)
    per_dataset = [[int(math.ceil(t * w * 1.005)) if t is not None else None for t in sizes] for w in weights]
    mids = builder._build_megatron_datasets_parallel(prefixes, cfg.split_matrix, per_dataset)[0]
    return Blended(mids, weights, sum(s[0] for s in per_dataset), cfg), cfg


def gpt_table(section: Mapping):
    dataset, cfg = build_gpt_dataset(section)
    produced = list(_MF_COLUMNS) + (["attention_mask"] if cfg.create_attention_mask else [])
    names = list(section.get("input_columns") or ["input_ids", "labels", "loss_mask", "position_ids"]
                 + (["attention_mask"] if cfg.create_attention_mask else []))
    if len(names) != len(produced):
        raise _err("train_dataset.input_columns", names, f"name {len(names)} columns but GPTDataset yields "
                   f"{len(produced)} (input_ids, labels, loss_mask, position_ids"
                   f"{', attention_mask' if cfg.create_attention_mask else ''}, in that order)",
                   "list one name per column, or set config.create_attention_mask to match")

    def get(i: int):
        s = dataset[i]
        return {n: np.asarray(s[k]).astype(np.int32) for n, k in zip(names, produced)}
    n = len(dataset)
    ident = np.arange(n, dtype=np.int64)
    return Table(n, get, lambda epoch, sharded: ident, names, "GPTDataset")
