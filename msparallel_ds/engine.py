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
- N costs no collective of its own where the batch agreement carries it (tp, cp, pp > 1) or, on dp-only ZeRO 1-3
  steps, once a step has counted it: then it is summed with the loss, the backward scales by the last step's N, and
  a step whose N differs is divided out by DeepSpeed before its update (token_count.py).
- fp32/bf16: a non-finite global loss stops the run before the optimizer step, a non-finite global gradient norm at
  the step it appears (loss.check_finite_step, FloatingPointError naming the step); fp16 keeps
  DeepSpeed's dynamic loss scaling (an overflowing step is skipped and counted).

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
from torch import Tensor, nn

from . import runtime
from .context_parallel.api import inputs_agreed
from .context_parallel.batch import inputs_and_targets
from .distributed.collectives import start_sum_over, sum_over
from .distributed.layout import ParallelLayout
from .loss import check_batch_and_count, check_finite_step, peer_dims, token_loss_sum
from .strategy import Applied
from .token_count import divided_by, divides_gradients

__all__ = ["Engine", "initialize"]

OptimizerArg = Union[None, torch.optim.Optimizer, Callable[[list], torch.optim.Optimizer]]


class Engine:
    """The parallel model, its DeepSpeed engine and layout. Build with msp.initialize."""

    def __init__(self, ds_engine, layout: ParallelLayout, plan, applied: Applied, lr_scheduler=None):
        self.ds, self.layout, self.plan, self.applied = ds_engine, layout, plan, applied
        self.optimizer, self.lr_scheduler = ds_engine.optimizer, lr_scheduler
        self.micro_batch_size = ds_engine.train_micro_batch_size_per_gpu()
        self.gradient_accumulation_steps = ds_engine.gradient_accumulation_steps()
        self.global_steps = 0
        # DeepSpeed divides the gradient sum over dp x cp by dp (ZeRO 0-2 multiply back the sequence-parallel
        # size; ZeRO-3 runs with cp = 1 only): the loss is pre-multiplied by it, so the update is d(sum of token
        # losses) / N.
        self._grad_divisor = layout.size("dp")
        self.last_aux_loss: Optional[float] = None  # the router's aux + z loss of the last step (logged apart)
        self.last_mtp_loss: Optional[float] = None  # the multi-token-prediction cross-entropy (logged apart)
        if applied.aux_loss is not None:  # DeepSpeed divides by dp; micro-batches are averaged like the LM loss
            applied.aux_loss.deepspeed_scale(layout.size("dp"), self.gradient_accumulation_steps)
        # ZeRO-0 with expert parallel: the true global norm is ours (runtime.deepspeed_config turned DeepSpeed's off)
        self._own_norm: Optional[float] = None
        self._own_clip = (plan.gradient_clipping if layout.size("ep") > 1 and ds_engine.zero_optimization_stage() == 0
                          and not ds_engine.gradient_clipping() else None)
        # dp-only steps: after one counted step, the token count rides in the loss sum's all-reduce (token_count)
        summed_copies = applied.interleave is not None and applied.interleave.copy_loss == "sum"
        self._defer_count = (divides_gradients(ds_engine) and applied.aux_loss is None and applied.mtp is None
                             and layout.size("cp") == 1 and not summed_copies)
        self._count_ref: Optional[Tensor] = None  # the last counted step's global token count
        self._step_count: Optional[Tensor] = None  # this step's, once the loss sum's all-reduce is done

    @property
    def model(self) -> nn.Module:
        return self.ds.module

    @property
    def device(self) -> torch.device:
        return self.ds.device

    @property
    def spec(self):
        """The shard spec parallelize cut the model by (name -> tp split), for gathers and checkpoints."""
        return self.applied.spec

    # ------------------------------------------------------------------------------------------ batches
    def _micro(self, batch: Mapping[str, Any], rows: slice) -> dict:
        micro = {k: (v[rows] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == len(batch["input_ids"])
                     else v) for k, v in batch.items()}
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in micro.items()}

    def _token_loss_sum(self, logits: Tensor, targets: Tensor) -> Tensor:
        return token_loss_sum(logits, targets, self.applied.output_head(self.model))

    def train_batch(self, batch: Mapping[str, Any]) -> Tensor:
        """One optimizer step on this dp rank's share of the global batch; returns the global-batch mean loss
        (detached, float32) on every rank."""

        mtp = self.applied.mtp  # each MTP depth's token count joins the LM's in one collective
        shifted = isinstance(batch, Mapping) and batch.get("shift_labels") is not None  # (S per row) win over labels

        def counted(labels: Tensor) -> list[Tensor]:
            if shifted:
                if mtp is not None:
                    raise ValueError("train_batch: batch['shift_labels'] with MTP (mtp_depth > 0) is not supported; "
                                     "pass HF-style batch['labels'] instead")
                labels = batch["shift_labels"]
            return [labels, *(mtp.shifted_labels(labels) if mtp is not None else [])]

        # The step's global token count: inside the batch agreement's one all-gather when peers are checked (tp, cp
        # or pp > 1), else an all-reduce over dp started now (hidden behind the first forward), or, after a counted
        # step, inside the loss sum's all-reduce (token_count). With the agreement checked the cp attention's
        # per-call check is not needed.
        deferred = self._count_ref is not None and self._defer_count and not peer_dims(self)
        _, all_labels, counts_ready = check_batch_and_count(
            batch, self, "runner_config.gradient_accumulation_steps", counted, shifted=shifted,
            n_counts=1 + (mtp.depth if mtp is not None else 0), sum_counts=not deferred)
        agreed = self.layout.size("cp") > 1 and getattr(self, "check_batch_agreement", True)
        with inputs_agreed(self.layout, agreed):
            return self._step(batch, all_labels, counts_ready, shifted, counts_ready() if deferred else None)

    def _step(self, batch: Mapping[str, Any], all_labels: list[Tensor], counts_ready: Callable[[], Tensor],
              shifted: bool, local_count: Optional[Tensor]) -> Tensor:
        """One optimizer step; local_count (deferred count): this rank's token count, summed with the loss, while
        the backward scales by the last counted step's global count."""
        dp, gas = self.layout.size("dp"), self.gradient_accumulation_steps
        labels, mtp = all_labels[0], self.applied.mtp
        interleave = self.applied.interleave
        summed_copies = interleave is not None and interleave.copy_loss == "sum"  # MindSpore's (interleave.multi_copy)
        # Step-level values plain DeepSpeed does not reduce: the global token count (before the first backward) and
        # the step's loss sum (before the optimizer step). Both run async, the count's behind the first forward (or
        # inside the batch agreement), the loss's behind the last backward; one blocking all-reduce of both after a
        # single micro-batch's forward measured slower (benchmarks/README.md, overhead): a rendezvous mid-step.
        # A deferred count (local_count) has none: it joins the loss sum's all-reduce (token_count.py).
        counts = self._count_ref if local_count is not None else None
        mtp_total = torch.zeros(len(all_labels) - 1, dtype=torch.float32, device=self.device)
        if not self.model.training:  # the recursive walk costs ~0.3 ms a step on a tiny model; once is enough
            self.model.train()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for m in range(gas):
            rows = slice(m * self.micro_batch_size, (m + 1) * self.micro_batch_size)
            micro = self._micro(batch, rows)
            inputs, targets = inputs_and_targets(micro, self.layout)
            mtp_targets = mtp.prepare(micro, self.layout) if mtp is not None else []
            out = self.ds(**inputs, use_cache=False)
            logits = out.logits if hasattr(out, "logits") else out[0]
            if summed_copies:
                from .interleave.multi_copy import copy_loss_terms

                loss = copy_loss_terms(self._token_loss_sum, logits, targets, labels[rows], interleave.copies,
                                       shifted=shifted)
                total_ready = self._add_to_total(m, total, loss)
                self.ds.backward(loss / gas, scale_wrt_gas=False)
                self._optimizer_step(m, total_ready)
                continue
            loss_sum = self._token_loss_sum(logits, targets)
            total_ready = self._add_to_total(m, total, loss_sum, local_count)
            counts = counts if counts is not None else counts_ready()
            loss = loss_sum * (self._grad_divisor / counts[0])
            if mtp is not None:  # mtp_loss_scaling_factor / D x each depth's token mean, logged apart
                sums = mtp.loss_sums(self.applied.output_head(self.model), mtp_targets)
                loss = loss + sum(s_ * (self._grad_divisor * mtp.scale / mtp.depth / n)
                                  for s_, n in zip(sums, counts[1:]))
                mtp_total += torch.stack([s_.detach().float() for s_ in sums])
            self.ds.backward(loss, scale_wrt_gas=False)
            self._optimizer_step(m, total_ready, deferred=local_count is not None)
        if local_count is not None:
            counts = self._step_count
        else:
            counts = counts if counts is not None else counts_ready()
            if self._defer_count:
                self._count_ref = counts[:1].clone()
        n_tokens, mtp_counts = counts[0], counts[1:]
        self._after_step()
        self._log_aux_loss()
        if mtp is not None:  # each depth's global token-mean cross-entropy, averaged over depths
            self.last_mtp_loss = float((sum_over(self.layout, "dp_cp", mtp_total) / mtp_counts).mean())
        if self.applied.expert_bias is not None:  # aux-loss-free balancing: after the step, from its global loads
            self.applied.expert_bias.update()
        self.global_steps += 1
        if summed_copies:  # MindFormers logs the summed loss / N; averaged over dp ranks and micro-batches
            return total / (dp * gas * interleave.copies)
        return total / n_tokens

    def _add_to_total(self, micro: int, total: Tensor, loss_sum: Tensor,
                      local_count: Optional[Tensor] = None) -> Optional[Callable[[], Tensor]]:
        """Add a micro-batch's loss sum to the step's total; at the last micro-batch start summing the total over
        dp x cp (before its backward, which then hides the latency) and return the wait for it. With local_count
        (a deferred count, cp = 1) the count is summed in the same all-reduce and kept as self._step_count."""
        total += loss_sum.detach().float()
        if micro != self.gradient_accumulation_steps - 1:
            return None
        if local_count is None:
            return start_sum_over(self.layout, "dp_cp", total)
        both = torch.cat([total.view(1), local_count])
        wait = start_sum_over(self.layout, "dp_cp", both)

        def ready() -> Tensor:
            summed = wait()
            total.copy_(summed[0])
            self._step_count = summed[1:].clamp_min(1.0)
            return total

        return ready

    def _optimizer_step(self, micro: int, total_ready: Optional[Callable[[], Tensor]], deferred: bool = False) -> None:
        """DeepSpeed's step after our checks; with a deferred count whose global value differs from the reference the
        backward scaled by, DeepSpeed divides this step's gradients by their ratio, and the run counts first from
        now on (token_count)."""
        self._before_step(micro, total_ready)
        factor = None
        if deferred and micro == self.gradient_accumulation_steps - 1:
            n, ref = float(self._step_count[0]), float(self._count_ref[0])
            if n != ref:
                factor = n / ref
                self._defer_count, self._count_ref = False, None
        with divided_by(self.ds, factor):
            self.ds.step()

    def _log_aux_loss(self) -> None:
        """The step's aux + z loss: every shard's share (recorded by the backward of each micro-batch) summed over
        dp x cp x tp, averaged over micro-batches (MindFormers logs it apart from the LM loss)."""
        if self.applied.aux_loss is None:
            return
        t = self.applied.aux_loss.pop_total().float().to(self.device)
        self.applied.aux_loss.end_step()
        sum_over(self.layout, "dp_cp", t)
        sum_over(self.layout, "tp", t)
        self.last_aux_loss = float(t) / self.gradient_accumulation_steps

    def _before_step(self, micro: int, total_ready: Optional[Callable[[], Tensor]]) -> None:
        """At the accumulation boundary, before DeepSpeed's optimizer step: the step's loss summed over dp x cp (the
        global value on every rank, from _add_to_total's wait) must be finite, and our own clipping runs. fp16 keeps
        DeepSpeed's dynamic loss scaling, which skips an overflowing step and counts it (as MindSpore does), so it is
        not checked here."""
        if micro != self.gradient_accumulation_steps - 1:
            return
        total = total_ready()
        guard = not self.ds.fp16_enabled()
        if guard:
            check_finite_step(self.global_steps, loss=total)
        if self._own_clip:  # grads are reduced at the boundary
            from .distributed.collectives import clip_grad_norm_

            self._own_norm = float(clip_grad_norm_(self._grads(), self._own_clip, self.layout, device=self.device))
            if guard:
                check_finite_step(self.global_steps, grad_norm=self._own_norm)
        elif guard and self.ds.zero_optimization_stage() == 0:
            # DeepSpeed's ZeRO-0 step keeps no norm (its fp32 clip drops the one it computes): the global norm, for
            # the finite check and the log, costs what a per-rank flag would (one reduction per grad, one all-reduce)
            from .distributed.collectives import global_grad_norm

            self._own_norm = float(global_grad_norm(self._grads(), self.layout, device=self.device))
            check_finite_step(self.global_steps, grad_norm=self._own_norm)

    def _grads(self) -> list:
        """The parameters holding a gradient (listed only where a step needs them: the walk costs per step)."""
        return [p for p in self.model.parameters() if p.requires_grad and p.grad is not None]

    def _after_step(self) -> None:
        """DeepSpeed computes the global gradient norm inside its step: a non-finite one stops the run at this step
        (the update has been applied; engine.save refuses the non-finite state)."""
        if not self._own_clip and not self.ds.fp16_enabled():
            norm = self.ds.get_global_grad_norm()
            if norm is not None:
                check_finite_step(self.global_steps, grad_norm=norm, updated=True)

    @property
    def global_grad_norm(self) -> Optional[float]:
        """The last step's global gradient norm before clipping (None only where nothing computed one: a DeepSpeed
        override zero_optimization.compute_grad_norm: false)."""
        if self._own_norm is not None:
            return self._own_norm
        norm = self.ds.get_global_grad_norm()
        return None if norm is None else float(norm)

    # ------------------------------------------------------------------------------------------ weights
    def _zero3_gathered(self):
        from .checkpoint.hf import zero3_gathered

        return zero3_gathered(self.model, self.ds.zero_optimization_stage())

    def full_state_dict(self, *, rank0_only: bool = False) -> Optional[dict]:
        """The HF-keyed full state dict (tp shards and ZeRO-3 partitions gathered), on CPU; every rank must call."""
        from .checkpoint.reshard import gather_full_state_dict

        with self._zero3_gathered():
            return gather_full_state_dict(self.model, self.layout, spec=self.spec, rank0_only=rank0_only)

    def save_pretrained(self, save_dir: str, **hf_kwargs) -> None:
        """A normal HF checkpoint of the full (gathered) model, written by global rank 0; every rank must call."""
        from .checkpoint.hf import save_pretrained

        with self._zero3_gathered():
            save_pretrained(self.model, self.layout, save_dir, spec=self.spec, **hf_kwargs)

    def save(self, save_dir: str, *, sharded: bool = True, async_save: bool = False, replicas: int = 0) -> None:
        """A layout-independent checkpoint (weights, Adam moments, steps, lr scheduler): engine.load resumes it
        under this or any other layout (see msparallel_ds.checkpoint). Every rank must call. sharded (default): every
        rank writes only its chunks (torch.distributed.checkpoint); sharded=False: the former single file
        msp_universal.pt, gathered to global rank 0 (small models, tools that read it); async_save (sharded):
        return once the state is staged, the files are written while training goes on; replicas=1 (sharded): each
        rank's files are also written by a data-parallel peer, so a lost node's part loads from the copy."""
        from .checkpoint.zero import save_checkpoint

        save_checkpoint(self, save_dir, sharded=sharded, async_save=async_save, replicas=replicas)

    def load(self, load_dir: str) -> dict:
        """Resume from engine.save(dir), written under any layout; the next steps equal the uninterrupted run's."""
        from .checkpoint.zero import load_checkpoint

        return load_checkpoint(self, load_dir)


def initialize(model: Union[nn.Module, Callable[[], nn.Module]], cfg, optimizer: OptimizerArg = None, *,
               layout: Optional[ParallelLayout] = None, lr_scheduler=None,
               deepspeed_config: Optional[Mapping[str, Any]] = None, timeout_s: Optional[float] = None,
               total_steps: Optional[int] = None) -> Engine:
    """Parallelize `model` for the YAML `cfg` (path, dict, YAML text or ParallelConfig) and wrap it in DeepSpeed
    with our mpu. Starts torch.distributed from the launcher's environment if the script has not.
    `model` may be a zero-argument callable that builds it: it is called after the YAML has been checked against
    the launched world size, so a wrong launch stops every rank with the message before any weights exist.
    `deepspeed_config` entries override the plan's DeepSpeed config (e.g. {"steps_per_print": 10}).
    optimizer=None: msp.build_optimizer (the YAML's type with MindSpore's maths and MindFormers' decay groups);
    lr_scheduler=None: msp.build_lr_scheduler from the YAML's lr_schedule, whose total_steps -1 is `total_steps`."""
    import deepspeed

    from .config import ParallelConfig
    from .distributed.layout import init_parallel
    from .optim import build_lr_scheduler, build_optimizer, check_optim
    from .strategy import applied_to, parallelize

    if not isinstance(cfg, ParallelConfig):
        from .suggest.auto import load_config_auto

        cfg = load_config_auto(cfg)  # read once; parallel_mode: 2: the layout suggest chooses (warned)
    if not torch.cuda.is_available():  # before deepspeed.init_distributed, which would build the op on CPU
        runtime.disable_inference_shm_build()
    runtime.ensure_distributed(timeout_s)
    if layout is None:  # a model from msp.from_pretrained / msp.parallelize brings its layout
        done = applied_to(model) if isinstance(model, nn.Module) else None
        layout = done.layout if done is not None else init_parallel(cfg)
    check_optim(layout.plan.config, optimizer, lr_scheduler, total_steps)  # before any weights exist
    if not isinstance(model, nn.Module):
        model = model()
    if cfg.pet is not None:  # model_config.pet_config: LoRA injected before any split, only its weights train
        from .pet import apply_lora

        model = apply_lora(model, cfg.pet)
    plan = layout.plan
    if layout.size("pp") > 1:  # torch.distributed.pipelining schedules (DeepSpeed's PipelineModule takes no mpu)
        from .pipeline.engine import initialize_pipeline

        if deepspeed_config:
            raise ValueError("deepspeed_config overrides apply to the DeepSpeed engine, which pipeline_stage > 1 does "
                             "not use; drop them (the YAML drives the pipeline engine)")
        return initialize_pipeline(model, layout, optimizer, lr_scheduler=lr_scheduler, total_steps=total_steps)
    model = parallelize(model, layout)  # a no-op for a model msp.parallelize already did for this layout
    model.to(runtime.training_device(layout))
    runtime.cpu_float32(model, layout, plan)  # a model.half() on CPU trains in float32 (DeepSpeed's CPU path)
    ds_config = runtime.deepspeed_config(plan, layout, overrides=deepspeed_config, own_clip=True)
    params = [p for p in model.parameters() if p.requires_grad]
    if isinstance(optimizer, torch.optim.Optimizer):
        opt = optimizer
    elif optimizer is None:
        from .optim.muon import zero_for_muon

        opt = zero_for_muon(build_optimizer(model, plan.config), layout, ds_config)  # Muon: whole-matrix ZeRO-1
    else:
        opt = optimizer(params)
    if lr_scheduler is None:
        lr_scheduler = build_lr_scheduler(opt, plan.config, total_steps)
    from .moe.deepspeed import deepspeed_moe

    with deepspeed_moe(model, layout, opt):  # expert parameters reduced over the expert-data-parallel group
        ds_engine, _, _, sched = deepspeed.initialize(model=model, optimizer=opt, model_parameters=params,
                                                       config=ds_config, mpu=layout.mpu(), lr_scheduler=lr_scheduler)
    from .optim.muon import check_whole_matrices

    check_whole_matrices(opt)  # Muon's Newton-Schulz needs whole matrices: no ZeRO flat partitions
    return Engine(ds_engine, layout, plan, applied_to(model), sched)
