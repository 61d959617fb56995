"""MindFormers 2.1's Muon (core/optim/muon.py) as a torch optimizer.

Hidden matrices (2-D, and 3-D expert stacks batched per matrix) take the Muon update: heavy-ball momentum
m = momentum * m + g (no dampening), the Nesterov input g + momentum * m, five Newton-Schulz steps with
(3.4445, -4.7750, 2.0315) in bfloat16 on X / (||X||_F + 1e-7) (the wide orientation), then
p = p * (1 - lr * wd) - lr * matched_adamw_rms * sqrt(max(rows, cols)) * X. Everything else (embeddings, the output
head, norms, biases) takes AdamW with `adamw_betas` / `adamw_eps` (bias correction, eps outside the square root,
decoupled decay), as muon.py's _apply_adamw_update does.

Hand-written on purpose: torch.optim.Muon and DeepSpeed's muon_update keep an EMA momentum (buf.lerp(g, 1 - beta)),
which is (1 - momentum) x MindFormers' buffer and so rounds differently into bfloat16 and meets the 1e-7 (torch:
clamp) differently; torch's is 2-D only and DeepSpeed scales by sqrt(max(1, rows / cols)); DeepSpeed's
zeropower_via_newtonschulz5 has MindFormers' exact iteration but picks its dtype from the accelerator, so it cannot
run the float32 iteration the MindSpore fixture needs. The iteration below is the same ten lines.

Every matrix is orthogonalised whole. DeepSpeed's ZeRO hands the optimizer flat partitions (and its own ZeRO Muon
computes DeepSpeed's update, not this one), so optimizer parallel level1/2 runs as torch's ZeroRedundancyOptimizer
over dp x cp, experts over edp (zero_for_muon: each rank steps whole parameters, then broadcasts them; DeepSpeed at
stage 0; level2/3 warn and run so). Under tensor parallel a split matrix's Nesterov input is all-gathered over tp
along its shard dim (a fused [gate; up] / [q; k; v] parameter block by block, so the gathered matrix is the
unsharded one), every tp rank runs the same Newton-Schulz on it, scales by the whole shape and keeps its slice, as
MindFormers 2.1 does (core/optim/muon.py _perform_allgather_op / _slice_tensor_to_shards; pynative/optimizer/muon.py
full_tensor / distribute_tensor). The tp peers own the same parameters under whole-parameter ZeRO (equal local
shapes, the same greedy partition), so they gather together. Offload is refused (check_muon_layout before any
weights exist, check_whole_matrices after DeepSpeed), and so is tp with pipeline_stage > 1 (not wired there).
"""
from __future__ import annotations

import math
import warnings
import zlib
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["Muon", "muon_groups", "check_muon_layout", "check_whole_matrices", "zero_for_muon",
           "zeropower_via_newtonschulz5"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5  # muon.py's loop is range(5): its ns_steps argument is stored and never read
MF_NAMES = ("word_embeddings", "output_layer")  # gpt_model.py get_muon_filter: these stay on AdamW
_IGNORED = {"ns_steps": "its loop always runs 5 Newton-Schulz steps",
            "ns_coefficients": "it always uses (3.4445, -4.7750, 2.0315)",
            "comm_strategy": "it gathers a sharded matrix one way (here: all-gathered over tp, NS on every tp rank)"}


@torch.no_grad()
def zeropower_via_newtonschulz5(g: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """muon.py zeropower_via_newtonschulz5_2d / _3d: the last two dims are the matrix, leading dims a batch."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(NS_STEPS):
        a_mat = x @ x.mT
        b_mat = b * a_mat + c * a_mat @ a_mat
        x = a * x + b_mat @ x
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """Groups with use_muon=True take the Muon update, the others AdamW (muon_groups builds them); `ns_dtype` is the
    Newton-Schulz dtype (MindFormers: bfloat16; float32 only to compare with a float32 reference); `tp_group` the
    layout's tp process group, needed when a Muon matrix is split over tp (zero_for_muon sets it from the layout)."""

    def __init__(self, params, lr: float = 2e-2, weight_decay: float = 0.1, matched_adamw_rms: float = 0.2,
                 momentum: float = 0.95, nesterov: bool = True, adamw_betas=(0.95, 0.95), adamw_eps: float = 1e-8,
                 ns_dtype: torch.dtype = torch.bfloat16, tp_group=None):
        defaults = dict(lr=lr, weight_decay=weight_decay, matched_adamw_rms=matched_adamw_rms, momentum=momentum,
                        nesterov=nesterov, betas=tuple(adamw_betas), eps=adamw_eps, use_muon=None)
        super().__init__(params, defaults)
        if any(g["use_muon"] is None for g in self.param_groups):
            raise ValueError("Muon needs to know which parameters are hidden matrices: pass the groups of "
                             "msparallel_ds.optim.muon.muon_groups(model, groups) (or msp.build_optimizer's), or set "
                             "'use_muon' in each group")
        self.ns_dtype = ns_dtype
        self.tp_group = tp_group  # an attribute, not a default: param_groups stay picklable
        check_whole_matrices(self)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["use_muon"]:
                    self._muon(p, group)
                else:
                    self._adamw(p, group)
        return loss

    def _muon(self, p, group):
        if p.dim() not in (2, 3):
            check_whole_matrices(self)
        shard = _tp_shard(p, self.tp_group)  # before any state changes: a missing group is an error, not half a step
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        g = p.grad.float()
        m = state["momentum_buffer"]
        m.mul_(group["momentum"]).add_(g)
        u = g + group["momentum"] * m if group["nesterov"] else m
        if shard is not None:  # the whole matrix on every tp rank, Newton-Schulz on it, this rank's slice back
            u = shard.gather(u, self.tp_group)
        x, alpha = self._orthogonalise(u, p, group)
        if shard is not None:
            x = shard.local(x, dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group))
        p.mul_(1 - group["lr"] * group["weight_decay"]).add_(x.to(p.dtype), alpha=alpha)

    def _orthogonalise(self, u, p, group):
        """(X, alpha) for the whole (gathered) Nesterov input u: the step is alpha * X."""
        x = zeropower_via_newtonschulz5(u, self.ns_dtype).float()
        scale = math.sqrt(max(u.shape[-2:])) * group["matched_adamw_rms"]  # the whole matrix's shape
        return x, -group["lr"] * scale

    def rebuild_kwargs(self) -> dict:
        """The constructor's keyword arguments (zero_for_muon rebuilds this optimizer over its shard)."""
        d = self.defaults
        return dict(lr=d["lr"], weight_decay=d["weight_decay"], matched_adamw_rms=d["matched_adamw_rms"],
                    momentum=d["momentum"], nesterov=d["nesterov"], adamw_betas=d["betas"], adamw_eps=d["eps"],
                    ns_dtype=self.ns_dtype)

    def _adamw(self, p, group):
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        state["step"] += 1
        (b1, b2), lr, t = group["betas"], group["lr"], state["step"]
        g = p.grad.float()
        state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (state["exp_avg_sq"] / (1 - b2 ** t)).sqrt_().add_(group["eps"])
        p.mul_(1 - lr * group["weight_decay"]).addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1 ** t))


def _tp_shard(p: torch.Tensor, tp_group):
    """The Shard a tp-split parameter was cut by (tensor_parallel.spec; read from the Megatron attributes the TP
    layers set), or None for a matrix that is whole on this rank. Routed experts under ep carry the attribute too
    (moe.apply, for DeepSpeed's norm) but are whole experts, split over ep: none."""
    if getattr(p, "expert_parallel", False) or not getattr(p, "tensor_model_parallel", False):
        return None
    if tp_group is None:
        raise ValueError(
            "optimizer.type=Muon got a matrix split over tensor parallel but no tp group: Newton-Schulz must see the "
            "gathered matrix; build the engine with msp.initialize (it sets the group from the layout), or set "
            "optimizer.tp_group = layout.group('tp') on the Muon before its first step")
    from ..tensor_parallel.spec import Shard

    return Shard(p.partition_dim, "split", parts=getattr(p, "partition_stride", 1))


def _adamw_only(model: nn.Module) -> set[int]:
    """Embedding tables and the output head (by module type / the HF accessors, and MindFormers' own names)."""
    ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for accessor in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, accessor, None)
        module = fn() if callable(fn) else None
        if isinstance(module, nn.Module):
            ids.update(id(p) for p in module.parameters())
    ids.update(id(p) for n, p in model.named_parameters() if any(k in n for k in MF_NAMES))
    return ids


def muon_groups(model: nn.Module, groups: Iterable[dict], adamw: set[int] | None = None) -> list[dict]:
    """MindFormers' decay / schedule groups, each split into its Muon part (2-D and 3-D hidden matrices) and its
    AdamW part (the rest), gpt_model.py get_muon_filter's rule; `adamw`: ids of matrices kept on AdamW (default:
    the embeddings and the output head)."""
    adamw = _adamw_only(model) if adamw is None else adamw
    out = []
    for g in groups:
        parts: dict[bool, list] = {True: [], False: []}
        for p in g["params"]:
            parts[p.dim() in (2, 3) and id(p) not in adamw].append(p)
        for use, params in parts.items():
            if params:
                out.append({**g, "params": params, "use_muon": use,
                            "group_name": f"{g['group_name']}_{'muon' if use else 'adamw'}"})
    return out


def check_muon_layout(cfg, pynative: bool = False) -> None:
    """Refuse, before any weights exist, the layouts where a Muon matrix would not be whole at step time;
    `pynative`: the YAML runs MindFormers 2.1's pynative Muon (muon_pynative), which reads the keys 2.1's core
    Muon ignores (warned here otherwise) and whose QK-clip muon_pynative.warn_qk_clip judges with the model."""
    opt, poc = cfg.optimizer, cfg.parallel.parallel_optimizer_config
    if opt.swap:  # offload (with or without enable_parallel_optimizer) is DeepSpeed ZeRO
        raise ValueError(
            "optimizer.type=Muon with optimizer.swap=True is not supported: DeepSpeed's optimizer offload needs its "
            "ZeRO, whose flat partitions Newton-Schulz cannot use (it needs each whole matrix); set optimizer.swap: "
            "False")
    if cfg.parallel.enable_parallel_optimizer and poc.optimizer_level != "level1":
        warnings.warn(
            f"optimizer.type=Muon with parallel_optimizer_config.optimizer_level={poc.optimizer_level} runs as level1: "
            "Newton-Schulz needs whole matrices, so the optimizer state is sharded by whole parameters over "
            "data_parallel x context_parallel (torch ZeroRedundancyOptimizer) and parameters and gradients stay whole "
            "on every rank (more memory than the plan's ZeRO estimate)", stacklevel=3)
    pc = cfg.parallel_config
    if pc.model_parallel > 1 and pc.pipeline_stage > 1:
        raise ValueError(
            f"optimizer.type=Muon with parallel_config.model_parallel={pc.model_parallel} and pipeline_stage="
            f"{pc.pipeline_stage} is not supported: the pipeline engine does not give Muon the tp group it needs to "
            "gather each split matrix before Newton-Schulz; set pipeline_stage: 1 (Muon runs under tensor parallel "
            "there) or model_parallel: 1")
    if pynative:
        return
    for key, why in _IGNORED.items():
        if getattr(opt, key, None) is not None:
            warnings.warn(f"optimizer.{key}={getattr(opt, key)!r} is not read by MindFormers 2.1's Muon ({why}); it "
                          "is ignored here too, so the update matches MindFormers 2.1", stacklevel=3)
    if opt.qk_clip_enabled:
        warnings.warn("optimizer.qk_clip_enabled=True: MindFormers' QK-clip (gpt_model.py apply_qk_clip_scaling, "
                      "rescaling Multi-Latent-Attention q/k weights from the step's max attention logit) is not "
                      "applied here; the Muon and AdamW updates are", stacklevel=3)


def _check_tp_peers(opt: Muon, layout) -> None:
    """Every step gathers each tp-split matrix over tp, so the tp peers must step the same ones in the same order.
    ZeRO's greedy partition by size gives them the same (their local shapes are equal); checked once, so a
    difference is one clear error instead of a hang in the first step's gather."""
    from ..distributed.collectives import gather_ints

    shapes = [tuple(p.shape) for g in opt.param_groups if g["use_muon"] for p in g["params"]
              if _tp_shard(p, opt.tp_group) is not None]
    rows = gather_ints([len(shapes), zlib.crc32(repr(shapes).encode())], opt.tp_group, layout.device_type)
    if any(row != rows[0] for row in rows):
        raise ValueError(
            f"optimizer.type=Muon under parallel_config.model_parallel={layout.size('tp')} with optimizer parallel: "
            f"the tp ranks' ZeRO shards hold different split matrices ({rows[layout.rank('tp')][0]} here; counts "
            f"and shape hashes per tp rank: {rows}), so they could not gather them together; the tp-split weights "
            "must have equal shapes on every tp rank (sizes divisible by model_parallel)")


def check_whole_matrices(optimizer: torch.optim.Optimizer) -> None:
    """After DeepSpeed wrapped the optimizer: every Muon parameter still a 2-D/3-D matrix (not a flat partition)."""
    for group in optimizer.param_groups:
        if group.get("use_muon") and any(p.dim() not in (2, 3) for p in group["params"]):
            raise ValueError(
                "optimizer.type=Muon got flat parameter partitions (a ZeRO stage > 0 from parallel."
                "enable_parallel_optimizer or a deepspeed_config override, or DeepSpeed's fused fp16/bf16 optimizer "
                "wrapper): Newton-Schulz needs each whole matrix; drop zero_optimization overrides, or let msp.initialize "
                "build the YAML's Muon (optimizer=None), which runs parallel.enable_parallel_optimizer as "
                "torch's ZeroRedundancyOptimizer over whole parameters")


def zero_for_muon(opt: torch.optim.Optimizer, layout, ds_config: dict) -> torch.optim.Optimizer:
    """Muon under optimizer parallel (any level): ZeroRedundancyOptimizer over whole parameters instead of DeepSpeed's
    ZeRO (whose flat partitions Newton-Schulz cannot use); `ds_config` is set to stage 0 in place. Dense parameters
    are sharded over dp x cp; with expert parallel the experts (the same only on their expert-data-parallel ranks)
    get their own ZeRO over edp (pipeline.zero.SplitZero), as DeepSpeed shards expert groups."""
    zero = ds_config.get("zero_optimization") or {}
    tp_group = layout.group("tp") if layout.size("tp") > 1 else None
    if isinstance(opt, Muon):
        opt.tp_group = tp_group
    if not isinstance(opt, Muon) or not zero.get("stage"):
        return opt
    ds_config["zero_optimization"] = {"stage": 0}
    experts = layout.size("ep") > 1
    if experts:  # DeepSpeed's ZeRO-0 clip averages per-rank norms (experts differ): engine.Engine clips with the
        ds_config["gradient_clipping"] = 0.0  # global norm instead, as runtime.deepspeed_config arranges for ZeRO-0
    if layout.size("dp_cp") == 1 and not experts:
        return opt
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls, kwargs = type(opt), opt.rebuild_kwargs()  # Muon or PynativeMuon

    def sharded(groups: list[dict], dim: str) -> torch.optim.Optimizer:
        groups = [g for g in groups if g["params"]]
        if layout.size(dim) == 1:
            return cls(groups, tp_group=tp_group, **kwargs)
        zero_opt = ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=layout.group(dim), **kwargs)
        zero_opt.optim.tp_group = tp_group  # the local Muon (a kwarg would land in every param group)
        if tp_group is not None:
            _check_tp_peers(zero_opt.optim, layout)
        return zero_opt

    if experts:
        from ..pipeline.zero import SplitZero

        def part(expert: bool) -> list[dict]:
            return [{**g, "params": [p for p in g["params"] if getattr(p, "expert_parallel", False) == expert]}
                    for g in opt.param_groups]

        zero_opt = SplitZero(sharded(part(False), "dp_cp"), sharded(part(True), "edp"))
    else:
        zero_opt = sharded(opt.param_groups, "dp_cp")
    zero_opt.mindformers_type = getattr(opt, "mindformers_type", "Muon")
    return zero_opt
