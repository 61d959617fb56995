"""msp.initialize(model, cfg, optimizer=...) -> Engine: one training entry over DeepSpeed ZeRO with our mpu.

    engine = msp.initialize(model, "run.yaml", optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    loss = engine.train_batch(batch)   # this dp rank's share of one global step: [global_batch/dp, S] tensors

What train_batch does, and why:
- The batch splits into gradient_accumulation_steps micro-batches of train_micro_batch_size_per_gpu rows
  (runner_config.batch_size x micro_batch_interleave_num: the copies run inside one forward).
- The loss is the token mean over the GLOBAL batch (HF's loss with num_items_in_batch, Megatron's per-token loss):
  every rank back-propagates sum(its token losses) x dp / N, N = valid tokens of the global batch. DeepSpeed sums
  gradients over dp x cp and divides by dp, so the update is exactly d(sum over all tokens / N) whatever the
  micro-batches, cp shards or ignored labels (a mean of per-micro-batch means would weigh tokens unequally).
  DeepSpeed's own 1/gas scaling is switched off for that reason (scale_wrt_gas=False).
- cp > 1: each micro-batch is sharded with context_parallel.batch.shard_batch (labels shifted before the split,
  global position_ids, doc_ids for packed rows). tp ranks of one dp rank must be fed the same batch.
- The returned loss is the global-batch mean on every rank (sum all-reduced over dp x cp; tp peers agree).

With parallel_config.pipeline_stage > 1, msp.initialize returns msparallel_ds.pipeline.engine.PipelineEngine instead
(torch.distributed.pipelining schedules; same train_batch / save / load / save_pretrained surface and loss semantics).

Precision follows the YAML (bf16/fp16 through DeepSpeed) on GPU; on CPU the run is fp32 (a warning says so).
The optimizer is a torch optimizer: a callable params -> Optimizer (recommended, it sees the sharded
parameters), an Optimizer built on the parallelized model, or None for the YAML's optimizer section as
torch.optim.AdamW (DeepSpeed's fused optimizers would need a C++/CUDA build).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from . import runtime

__all__ = ["Engine", "initialize"]

IGNORE_INDEX = -100
OptimizerArg = Union[None, torch.optim.Optimizer, Callable[[list], torch.optim.Optimizer]]


def check_batch(batch: Mapping[str, Any], engine, accumulation_key: str) -> tuple[Tensor, Tensor]:
    """(input_ids, labels) of train_batch's `batch`, which must be this dp rank's share of one global step:
    engine.micro_batch_size x engine.gradient_accumulation_steps rows (accumulation_key names the YAML key of the
    latter)."""
    ids = batch.get("input_ids")
    if ids is None or ids.dim() != 2:
        raise ValueError("train_batch needs batch['input_ids'] of shape [rows, seq] (this dp rank's share of the "
                         "global batch)")
    rows = engine.micro_batch_size * engine.gradient_accumulation_steps
    if ids.shape[0] != rows:
        raise ValueError(
            f"train_batch got {ids.shape[0]} rows; this dp rank's share of a global step is {rows} = "
            f"runner_config.batch_size x micro_batch_interleave_num ({engine.micro_batch_size}) x {accumulation_key} "
            f"({engine.gradient_accumulation_steps}); global batch {engine.plan.global_batch_size} / data_parallel "
            f"{engine.layout.size('dp')}")
    labels = batch.get("labels", ids)
    if labels.shape != ids.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(ids.shape)}")
    return ids, labels


def global_token_count(labels: Tensor, layout, device) -> Tensor:
    """Valid (shifted, not ignored) tokens of the global batch from this dp rank's labels, at least 1, fp32; tp
    and cp peers of a dp rank hold the same rows, so the sum runs over dp only."""
    from .context_parallel.batch import shift_labels

    count = (shift_labels(labels) != IGNORE_INDEX).sum().to(torch.float32).to(device)
    if layout.size("dp") > 1:
        dist.all_reduce(count, group=layout.group("dp"))
    return count.clamp_min(1.0)


def token_loss_sum(logits: Tensor, targets: Tensor, lm_head: Optional[nn.Module]) -> Tensor:
    """Sum of the token cross-entropies (ignored labels skipped), in fp32; vocab-parallel logits [..., V/tp] when the
    head is a vocab-parallel lm_head."""
    if getattr(lm_head, "tp", 1) > 1 and hasattr(lm_head, "gather_logits"):
        from .tensor_parallel.vocab import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits, targets, lm_head.group, IGNORE_INDEX, "sum")
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


class Engine:
    """The parallel model, its DeepSpeed engine and layout. Build with msp.initialize."""

    def __init__(self, ds_engine, layout, plan, lr_scheduler=None):
        self.ds, self.layout, self.plan = ds_engine, layout, plan
        self.optimizer, self.lr_scheduler = ds_engine.optimizer, lr_scheduler
        self.micro_batch_size = ds_engine.train_micro_batch_size_per_gpu()
        self.gradient_accumulation_steps = ds_engine.gradient_accumulation_steps()
        self.global_steps = 0
        # DeepSpeed divides the gradient sum over dp x cp by dp (ZeRO 0-2 multiply back the sequence-parallel
        # size; ZeRO-3 runs with cp = 1 only): the loss is pre-multiplied by it, so the update is d(sum of token
        # losses) / N.
        self._grad_divisor = layout.size("dp")

    @property
    def model(self) -> nn.Module:
        return self.ds.module

    @property
    def device(self) -> torch.device:
        return self.ds.device

    # ------------------------------------------------------------------------------------------ batches
    def _check_batch(self, batch: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
        return check_batch(batch, self, "runner_config.gradient_accumulation_steps")

    def _micro_inputs(self, batch: Mapping[str, Any], rows: slice) -> tuple[dict, Tensor]:
        from .context_parallel.batch import inputs_and_targets

        micro = {k: (v[rows] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == len(batch["input_ids"])
                     else v) for k, v in batch.items()}
        micro = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in micro.items()}
        return inputs_and_targets(micro, self.layout)

    def _token_loss_sum(self, logits: Tensor, targets: Tensor) -> Tensor:
        return token_loss_sum(logits, targets, getattr(self.model, "lm_head", None))

    def train_batch(self, batch: Mapping[str, Any]) -> Tensor:
        """One optimizer step on this dp rank's share of the global batch; returns the global-batch mean loss
        (detached, float32) on every rank."""

        ids, labels = self._check_batch(batch)
        dp = self.layout.size("dp")
        n_tokens = global_token_count(labels, self.layout, self.device)
        self.model.train()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        interleave = getattr(self.model, "msp_interleave", None) or {}
        summed_copies = interleave.get("copy_loss") == "sum"  # MindSpore's summed copies (interleave.multi_copy)
        for m in range(self.gradient_accumulation_steps):
            rows = slice(m * self.micro_batch_size, (m + 1) * self.micro_batch_size)
            inputs, targets = self._micro_inputs(batch, rows)
            out = self.ds(**inputs, use_cache=False)
            logits = out.logits if hasattr(out, "logits") else out[0]
            if summed_copies:
                from .interleave.multi_copy import copy_loss_terms

                loss = copy_loss_terms(self._token_loss_sum, logits, targets, labels[rows], interleave["copies"])
                self.ds.backward(loss / self.gradient_accumulation_steps, scale_wrt_gas=False)
                self.ds.step()
                total += loss.detach().float()
                continue
            loss_sum = self._token_loss_sum(logits, targets)
            self.ds.backward(loss_sum * (self._grad_divisor / n_tokens), scale_wrt_gas=False)
            self.ds.step()
            total += loss_sum.detach().float()
        if self.layout.size("dp_cp") > 1:
            dist.all_reduce(total, group=self.layout.group("dp_cp"))
        self.global_steps += 1
        if summed_copies:  # MindFormers logs the summed loss / N; averaged over dp ranks and micro-batches
            return total / (dp * self.gradient_accumulation_steps * interleave["copies"])
        return total / n_tokens

    # ------------------------------------------------------------------------------------------ weights
    def _zero3_gathered(self):
        from .weights import zero3_gathered

        return zero3_gathered(self.model, self.ds.zero_optimization_stage())

    def full_state_dict(self, *, rank0_only: bool = False) -> Optional[dict]:
        """The HF-keyed full state dict (tp shards and ZeRO-3 partitions gathered), on CPU; every rank must call."""
        from .weights import gather_full_state_dict

        with self._zero3_gathered():
            return gather_full_state_dict(self.model, self.layout, rank0_only=rank0_only)

    def save_pretrained(self, save_dir: str, **hf_kwargs) -> None:
        """A normal HF checkpoint of the full (gathered) model, written by global rank 0; every rank must call."""
        from .weights import save_pretrained

        with self._zero3_gathered():
            save_pretrained(self.model, self.layout, save_dir, **hf_kwargs)

    def save(self, save_dir: str) -> None:
        """A layout-independent checkpoint (weights, Adam moments, steps, lr scheduler): engine.load resumes it
        under this or any other layout (see msparallel_ds.checkpoint). Every rank must call."""
        from .checkpoint import save_checkpoint

        save_checkpoint(self, save_dir)

    def load(self, load_dir: str) -> dict:
        """Resume from engine.save(dir), written under any layout; the next steps equal the uninterrupted run's."""
        from .checkpoint import load_checkpoint

        return load_checkpoint(self, load_dir)


def initialize(model: Union[nn.Module, Callable[[], nn.Module]], cfg, optimizer: OptimizerArg = None, *,
               layout=None, lr_scheduler=None, deepspeed_config: Optional[Mapping[str, Any]] = None,
               timeout_s: Optional[float] = None) -> Engine:
    """Parallelize `model` for the YAML `cfg` (path, dict, YAML text or ParallelConfig) and wrap it in DeepSpeed
    with our mpu. Starts torch.distributed from the launcher's environment if the script has not.
    `model` may be a zero-argument callable that builds it: it is called after the YAML has been checked against
    the launched world size, so a wrong launch stops every rank with the message before any weights exist.
    `deepspeed_config` entries override the plan's DeepSpeed config (e.g. {"steps_per_print": 10})."""
    import deepspeed

    from .config import ParallelConfig, load_config
    from .distributed.layout import init_parallel
    from .strategy import parallelize

    cfg = cfg if isinstance(cfg, ParallelConfig) else load_config(cfg)
    if not torch.cuda.is_available():  # before deepspeed.init_distributed, which would build the op on CPU
        runtime.disable_inference_shm_build()
    runtime.ensure_distributed(timeout_s)
    if layout is None:  # a model from msp.from_pretrained / msp.parallelize brings its layout
        layout = getattr(model, "msp_layout", None) or init_parallel(cfg)
    if not isinstance(model, nn.Module):
        model = model()
    plan = layout.plan
    if layout.size("pp") > 1:  # torch.distributed.pipelining schedules (DeepSpeed's PipelineModule takes no mpu)
        from .pipeline.engine import initialize_pipeline

        if deepspeed_config:
            raise ValueError("deepspeed_config overrides apply to the DeepSpeed engine, which pipeline_stage > 1 does "
                             "not use; drop them (the YAML drives the pipeline engine)")
        return initialize_pipeline(model, layout, optimizer, lr_scheduler=lr_scheduler)
    model = parallelize(model, layout)
    model.to(runtime.training_device(layout))
    ds_config = runtime.deepspeed_config(plan, layout, overrides=deepspeed_config)
    params = [p for p in model.parameters() if p.requires_grad]
    if isinstance(optimizer, torch.optim.Optimizer):
        opt = optimizer
    else:
        opt = (optimizer or runtime.torch_optimizer(plan))(params)
    ds_engine, _, _, sched = deepspeed.initialize(model=model, optimizer=opt, model_parameters=params,
                                                   config=ds_config, mpu=layout.mpu(), lr_scheduler=lr_scheduler)
    return Engine(ds_engine, layout, plan, sched)
