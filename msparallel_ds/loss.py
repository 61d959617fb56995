"""The global-batch token mean both engines train on: the batch check, the global token count, the token-loss sum,
and the finite-step guard.

Every rank back-propagates sum(its token losses) / N, N = valid (shifted, not ignored) tokens of the GLOBAL batch
(HF's loss with num_items_in_batch, Megatron's per-token loss), so micro-batches, cp shards, pipeline stages and
ignored labels weigh tokens exactly as one process would.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import math
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .labels import IGNORE_INDEX, shift_labels
from .distributed.collectives import gather_ints, start_sum_over
from .distributed.layout import ParallelLayout

__all__ = ["check_batch", "check_batch_and_count", "check_finite_step", "global_token_count", "global_token_counts",
           "peer_dims", "start_global_token_counts", "token_loss_sum"]


def check_batch(batch: Mapping[str, Any], engine, accumulation_key: str) -> tuple[Tensor, Tensor]:
    """(input_ids, labels) of train_batch's `batch`, which must be this dp rank's share of one global step:
    engine.micro_batch_size x engine.gradient_accumulation_steps rows (accumulation_key names the YAML key of the
    latter) of integer [rows, seq] tensors, seq >= 1.

    Peer agreement (on by default): the tp, cp and pp peers of a dp rank must be fed the same rows, else they would
    train silently on a mixture (or abort inside a collective on different shapes). Before the step's first
    collective, every rank all-gathers a few int64 (ok flag, shapes, dtypes, two content hashes of input_ids and
    labels, the other entries' names, shapes and dtypes) over the world, and every rank raises one clear error when
    any dp rank's peers differ or one rejected its batch. Set `engine.check_batch_agreement = False` to skip this
    tiny collective (the local checks still run). check_batch_and_count carries the step's token count in it.
    """
    ids, counted, _ = check_batch_and_count(batch, engine, accumulation_key, lambda labels: [labels], n_counts=0)
    return ids, counted[0]


def peer_dims(engine) -> list[str]:
    """The dims whose peers check_batch_and_count compares (tp, cp, pp > 1, with engine.check_batch_agreement on):
    where there are none, the step's token count needs a collective of its own."""
    if not getattr(engine, "check_batch_agreement", True):
        return []
    return [d for d in ("tp", "cp", "pp") if engine.layout.size(d) > 1]


def check_batch_and_count(batch: Mapping[str, Any], engine, accumulation_key: str,
                          counted: Callable[[Tensor], Sequence[Tensor]], *, shifted: bool = False,
                          n_counts: int = 1, sum_counts: bool = True
                          ) -> tuple[Tensor, list[Tensor], Callable[[], Optional[Tensor]]]:
    """check_batch, plus the step's global token counts (global_token_counts) of counted(labels): n_counts label
    tensors such as the LM's and each MTP depth's (`counted` may raise a ValueError for a batch it refuses, which
    counts as this rank rejecting its batch). Returns (input_ids, counted(labels), counts_ready); counts_ready()
    gives the counts (None for n_counts=0). With peer agreement on and tp, cp or pp > 1, the counts ride in the
    agreement's one all-gather (exact int64 sums over dp); otherwise their all-reduce over dp starts here and hides
    behind the step's first forward. sum_counts=False (no peer_dims only): counts_ready() gives this rank's own
    counts, unsummed and unclamped, for the caller to sum in a collective it makes anyway (the engine's loss sum).
    The agreement also stands for the cp attention's per-call check (context_parallel.api.inputs_agreed): peers
    fed the same batch call the same model's attention with the same shapes, so the step needs no more checks."""
    error: Optional[Exception] = None
    device = getattr(engine, "device", None)
    try:
        ids, labels = _local_check(batch, engine, accumulation_key)
        tensors = list(counted(labels))
    except (TypeError, ValueError) as e:
        ids = labels = tensors = None
        error = e
    dims = peer_dims(engine)
    if not dims:
        if error is not None:
            raise error
        if not n_counts:
            return ids, tensors, lambda: None
        if not sum_counts:
            local = _local_counts(tensors, device, shifted)
            return ids, tensors, lambda: local
        wait = start_sum_over(engine.layout, "dp", _local_counts(tensors, device, shifted))
        return ids, tensors, lambda: wait().clamp_min(1.0)
    if error is None:
        local = [int(((t if shifted else shift_labels(t)) != IGNORE_INDEX).sum()) for t in tensors[:n_counts]]
        meta = [*_fingerprint(batch, ids, labels), *local]
    else:
        meta = [0] * (_N_META + n_counts)
    rows = gather_ints([int(error is None), *meta], dist.group.WORLD, device)  # the step's first collective
    layout = engine.layout
    problems = _agreement_problems(layout, dims, rows, error)
    if error is not None:
        raise error
    if problems:
        raise ValueError(f"train_batch: the peers of this dp rank were fed different batches: {'; '.join(problems)}. "
                         f"tp, cp and pp peers of a dp rank must get the same rows (same shape, dtype and token ids): "
                         f"shard the data over data_parallel ranks only, e.g. DistributedSampler(dataset, "
                         f"num_replicas=layout.size('dp'), rank=layout.rank('dp')) or msparallel_ds.tiny.dp_rows, "
                         f"not over the world. (engine.check_batch_agreement = False skips this check.)")
    if not n_counts:
        return ids, tensors, lambda: None
    at = 1 + _N_META
    total = [sum(rows[g][at + i] for g in layout.ranks("dp")) for i in range(n_counts)]  # exact, in int64
    counts = torch.tensor(total, dtype=torch.float32, device=device).clamp_min(1.0)
    return ids, tensors, lambda: counts


def _integer_tensor(x: Any, name: str) -> Tensor:
    if not isinstance(x, Tensor) or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        got = f"a {x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"train_batch: batch[{name!r}] must be an integer torch.Tensor [rows, seq] of token ids, "
                        f"got {got}: convert it with torch.as_tensor(x, dtype=torch.long)")
    return x


def _local_check(batch: Mapping[str, Any], engine, accumulation_key: str) -> tuple[Tensor, Tensor]:
    if not isinstance(batch, Mapping):
        raise TypeError(f"train_batch needs a dict batch {{'input_ids': ..., 'labels': ...}}, got "
                        f"{type(batch).__name__}")
    ids = batch.get("input_ids")
    if ids is None:
        raise ValueError("train_batch needs batch['input_ids'] of shape [rows, seq] (this dp rank's share of the "
                         "global batch)")
    ids = _integer_tensor(ids, "input_ids")
    if ids.dim() != 2:
        raise ValueError(f"train_batch needs batch['input_ids'] of shape [rows, seq] (this dp rank's share of the "
                         f"global batch), got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError(f"train_batch got input_ids of shape {tuple(ids.shape)}: sequence length 0; every row needs "
                         f"at least one token (drop empty batches in the data loader)")
    rows = engine.micro_batch_size * engine.gradient_accumulation_steps
    if ids.shape[0] != rows:
        raise ValueError(
            f"train_batch got {ids.shape[0]} rows; this dp rank's share of a global step is {rows} = "
            f"runner_config.batch_size x micro_batch_interleave_num ({engine.micro_batch_size}) x {accumulation_key} "
            f"({engine.gradient_accumulation_steps}); global batch {engine.plan.global_batch_size} / data_parallel "
            f"{engine.layout.size('dp')}")
    labels = _integer_tensor(batch.get("labels", ids), "labels")
    if labels.shape != ids.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(ids.shape)}")
    if batch.get("shift_labels") is not None:  # already shifted targets (HF's convention); they win over labels
        targets = _integer_tensor(batch["shift_labels"], "shift_labels")
        if targets.shape != ids.shape:
            raise ValueError(f"shift_labels shape {tuple(targets.shape)} != input_ids shape {tuple(ids.shape)} "
                             f"(position t holds token t's target, {IGNORE_INDEX} for none)")
    return ids, labels


_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_N_META = 11  # input_ids rows, seq, dtype; labels rows, seq, dtype; two hashes of each; the other entries' hash
_OWN_KEYS = ("input_ids", "labels")


def _content_hash(t: Tensor) -> list[int]:
    """Two int64 sums (plain, position-weighted; wrapping arithmetic, so any device and order gives the same)."""
    x = t.detach().reshape(-1).to(torch.int64)
    w = torch.arange(1, x.numel() + 1, dtype=torch.int64, device=x.device) * 2654435761 + 40503
    return torch.stack([x.sum(), (x * w).sum()]).tolist()


def _fingerprint(batch: Mapping[str, Any], ids: Tensor, labels: Tensor) -> list[int]:
    from .distributed.collectives import dtype_code

    ids_hash = _content_hash(ids)
    others = sorted((str(k), (tuple(v.shape), str(v.dtype)) if isinstance(v, Tensor) else type(v).__name__)
                    for k, v in batch.items() if k not in _OWN_KEYS)  # e.g. shift_labels, position_ids, doc_ids
    return [*ids.shape, dtype_code(ids.dtype), *labels.shape, dtype_code(labels.dtype), *ids_hash,
            *(ids_hash if labels is ids else _content_hash(labels)), zlib.crc32(repr(others).encode()) & 0x7fffffff]


def _agreement_problems(layout, dims: list[str], rows: list[list[int]], error: Optional[Exception]) -> list[str]:
    """What this rank reports from every rank's [ok, fingerprint, counts] row: its own tp, cp and pp groups'
    rejections and differences first; else that another group of its block, or another dp rank's block, failed
    (every rank raises, so none is left waiting in the step's next collective)."""
    if error is not None:
        return []
    fp = slice(1, 1 + _N_META)
    problems: list[str] = []
    for dim in dims:
        ranks = layout.ranks(dim)
        mine = [rows[g] for g in ranks]
        rejected = [f"{dim} rank {i} (global rank {ranks[i]})" for i, r in enumerate(mine) if not r[0]]
        if rejected:
            problems.append(f"{', '.join(rejected)} rejected its batch (see the error on that rank)")
        elif any(r[fp] != mine[0][fp] for r in mine):
            problems.append(_disagreement(dim, [r[fp] for r in mine], ranks))
    if problems:
        return problems
    block = layout.size("cp") * layout.size("tp")  # rank = ((pp*dp + d)*cp + c)*tp + t: d = rank // block % dp
    bad_dp = sorted({g // block % layout.size("dp") for g, r in enumerate(rows) if not r[0]} |
                    {g // block % layout.size("dp") for g, r in enumerate(rows)
                     if r[fp] != rows[_block_head(g, layout)][fp]})
    if layout.rank("dp") in bad_dp:
        return ["peers in another group of this dp rank's tp x cp x pp block disagree (see their errors)"]
    if bad_dp:
        return [f"the peers of dp rank(s) {', '.join(map(str, bad_dp))} disagree or rejected their batch (see their "
                f"errors); this rank stops too, so none is left waiting in the step's collectives"]
    return []


def _block_head(g: int, layout) -> int:
    """The first global rank of g's dp rank's block (pp 0, cp 0, tp 0 of the same dp coordinate)."""
    block, dp = layout.size("cp") * layout.size("tp"), layout.size("dp")
    return (g // block % dp) * block


def _disagreement(dim: str, rows: list[list[int]], ranks: tuple[int, ...]) -> str:
    """Which peers differ from peer 0 of `dim`, and in what: shape, dtype, contents or the other entries."""
    from .distributed.collectives import dtype_code

    names = {dtype_code(d): str(d) for d in _INT_DTYPES}
    base, parts = rows[0], []
    for i, m in enumerate(rows[1:], start=1):
        what = []
        for name, at, hashed in (("input_ids", 0, 6), ("labels", 3, 8)):
            if m[at:at + 2] != base[at:at + 2]:
                what.append(f"{name} shape {tuple(m[at:at + 2])} vs {tuple(base[at:at + 2])}")
            elif m[at + 2] != base[at + 2]:
                what.append(f"{name} dtype {names.get(m[at + 2], '?')} vs {names.get(base[at + 2], '?')}")
            elif m[hashed:hashed + 2] != base[hashed:hashed + 2]:
                what.append(f"{name} contents (same shape, other token ids)")
        if m[10] != base[10]:
            what.append("the other batch entries (names, shapes or dtypes)")
        if what:
            parts.append(f"{dim} rank {i} (global rank {ranks[i]}) differs from {dim} rank 0 (global rank "
                         f"{ranks[0]}) in {', '.join(what)}")
    return "; ".join(parts)


def global_token_count(labels: Tensor, layout: ParallelLayout, device, *, shifted: bool = False) -> Tensor:
    """Valid (shifted, not ignored) tokens of the global batch from this dp rank's labels, at least 1, fp32; tp
    and cp peers of a dp rank hold the same rows, so the sum runs over dp only. shifted=True: `labels` are
    already shifted targets (a batch's `shift_labels`), counted as they are."""
    return global_token_counts([labels], layout, device, shifted=shifted)[0]


def global_token_counts(labels: Sequence[Tensor], layout: ParallelLayout, device, *, shifted: bool = False) -> Tensor:
    """global_token_count of several label tensors (e.g. the LM's and each MTP depth's) with one all-reduce."""
    return start_global_token_counts(labels, layout, device, shifted=shifted)()


def _local_counts(labels: Sequence[Tensor], device, shifted: bool) -> Tensor:
    return torch.stack([((t if shifted else shift_labels(t)) != IGNORE_INDEX).sum()
                        for t in labels]).to(torch.float32).to(device)


def start_global_token_counts(labels: Sequence[Tensor], layout: ParallelLayout, device, *,
                              shifted: bool = False) -> Callable[[], Tensor]:
    """global_token_counts with the all-reduce started now; the returned wait() gives the counts (the step's
    forward runs meanwhile, so the count costs no latency of its own)."""
    wait = start_sum_over(layout, "dp", _local_counts(labels, device, shifted))
    return lambda: wait().clamp_min(1.0)


def token_loss_sum(logits: Tensor, targets: Tensor, head: Optional[nn.Module]) -> Tensor:
    """Sum of the token cross-entropies (ignored labels skipped), in fp32; vocab-parallel logits [..., V/tp] when
    `head` (the model's output head) is a vocab-parallel one."""
    from .tensor_parallel.vocab import ParallelLMHead, vocab_parallel_cross_entropy

    if isinstance(head, ParallelLMHead) and head.tp > 1:
        return vocab_parallel_cross_entropy(logits, targets, head.group, IGNORE_INDEX, "sum")
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


# ---------------------------------------------------------------------------------------------- finite steps
def check_finite_step(steps_done: int, *, loss=None, grad_norm=None, updated: bool = False) -> None:
    """The finite-loss / grad-norm guard of both engines (fp32/bf16; fp16 keeps DeepSpeed's skip-and-count).
    `loss` and `grad_norm` are global values (the same on every rank), so every rank raises at the same step."""
    for what, value in (("global-batch loss", loss), ("global gradient norm", grad_norm)):
        if value is None:
            continue
        v = float(value)
        if math.isfinite(v):
            continue
        done = ("the optimizer step has already run, so the weights may be non-finite now (engine.save will refuse "
                "them)" if updated else "the optimizer step was not taken")
        raise FloatingPointError(
            f"train_batch: the {what} is {v} at step {steps_done + 1} (engine.global_steps={steps_done} before it); "
            f"{done}. Training diverged or this step's batch holds bad values: lower the learning rate "
            "(optimizer.learning_rate, or a longer warmup), enable gradient clipping (runner_wrapper.max_grad_norm), "
            "check this step's data, and resume from the last good checkpoint with engine.load")
