"""A tiny Llama and real text (byte-level tokens) for the demo, the examples and the tests: nothing downloads.

The text (msparallel_ds/data/public_domain.txt: the Gettysburg Address, six of Shakespeare's sonnets, the
Preamble of the US Constitution and the opening of the Declaration of Independence) is public domain. Tokens are
its UTF-8 bytes, so the vocabulary is 256.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .distributed.layout import ParallelLayout

__all__ = ["VOCAB", "dp_rows", "text_batches", "text_tokens", "tiny_llama", "tiny_llama_config"]

VOCAB = 256
TEXT = Path(__file__).with_name("data") / "public_domain.txt"


def text_tokens() -> torch.Tensor:
    """The whole text as byte ids (int64)."""
    return torch.tensor(list(TEXT.read_bytes()), dtype=torch.long)


def text_batches(steps: int, rows: int, seq_len: int, *, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`steps` global batches of `rows` windows of seq_len tokens at seeded random offsets of the text (the same
    on every rank and in a single-process reference): {"input_ids", "labels"} with labels = input_ids (HF shifts)."""
    tokens = text_tokens()
    if seq_len >= len(tokens):
        raise ValueError(f"seq_len={seq_len} must be shorter than the text ({len(tokens)} tokens)")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - seq_len, (rows,), generator=g)
        ids = torch.stack([tokens[s:s + seq_len] for s in starts.tolist()])
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def dp_rows(batch: dict[str, torch.Tensor], layout: ParallelLayout) -> dict[str, torch.Tensor]:
    """This dp rank's contiguous share of a global batch (tp and cp peers get the same rows)."""
    dp, d = layout.size("dp"), layout.rank("dp")
    rows = next(iter(batch.values())).shape[0]
    if rows % dp:
        raise ValueError(f"global batch of {rows} rows does not split over data_parallel={dp}")
    n = rows // dp
    return {k: v[d * n:(d + 1) * n] for k, v in batch.items()}


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, attention_dropout=0.0, tie_word_embeddings=False)
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_llama(seed: int = 0, **overrides):
    """A LlamaForCausalLM with seeded weights (identical on every rank), fp32."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).float()
