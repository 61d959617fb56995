"""optimizer.type: Muon in a MindFormers 2.1 pynative-schema YAML (`parallelism:` / `training:`, the deepseek4
configs) runs 2.1's pynative Muon (msparallel_ds.optim.muon_pynative): checked against that muon.py run by MindSpore
2.7 (tests/fixtures/mindspore_optim/muon_pynative.json: 5 steps, the YAMLs' 8 + 2 Newton-Schulz schedule, the fused
expert gate/up tensor orthogonalised and scaled as two halves, AdamW for embedding / head / norm / bias; float32
Newton-Schulz on both sides), through msp.build_optimizer; the deepseek4 YAML's keys read (no "not applied"
warnings), adamw_include, the bad values refused; and on 2 gloo processes, under whole-parameter ZeRO and under
tensor parallel (a tp-split fused expert gate/up gathered, then halved), against one process."""
import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import msparallel_ds as msp
from harness import run_distributed
from msparallel_ds.optim.muon import Muon
from msparallel_ds.optim.muon_pynative import PynativeMuon, newton_schulz, ns_schedule

FIX = json.loads((Path(__file__).parent / "fixtures" / "mindspore_optim" / "muon_pynative.json").read_text())
V4_YAML = Path(__file__).parent / "fixtures" / "mindformers21" / "pretrain_deepseek4_flash.yaml"
RTOL = 1e-5
MF = "decoder.layers.0."
NAMES = {  # ours -> (MindFormers name in the fixture, transposed: HF keeps [E, out, in], MindFormers [E, in, out])
    "layers.0.experts.gate_up_proj": (MF + "mlp.experts.weight1", True),
    "layers.0.experts.down_proj": (MF + "mlp.experts.weight2", True),
    "layers.0.attn.q_b.weight": (MF + "self_attention.linear_q_up_proj.weight", False),
    "layers.0.attn.kv.weight": (MF + "self_attention.linear_kv_proj.weight", False),
    "embed.weight": ("embedding.word_embeddings.weight", False),
    "head.weight": ("output_layer.weight", False),
    "layers.0.norm.weight": (MF + "input_layernorm.weight", False),
    "layers.0.router.bias": (MF + "mlp.router.bias", False),
}


def _t(values, transposed):
    t = torch.tensor(values, dtype=torch.float32)
    return t.mT.contiguous() if transposed else t


class Toy(nn.Module):
    """The fixture's tensors in HF's layout: an embedding table, an output head, fused experts, two projections."""

    def __init__(self):
        super().__init__()
        init = FIX["init"]
        self.embed = nn.Embedding(9, 6)
        self.head = nn.Linear(6, 9, bias=False)
        self.layers = nn.ModuleList([nn.Module()])
        layer = self.layers[0]
        layer.experts, layer.attn, layer.norm, layer.router = nn.Module(), nn.Module(), nn.Module(), nn.Module()
        layer.experts.gate_up_proj = nn.Parameter(torch.zeros(2, 8, 6))
        layer.experts.down_proj = nn.Parameter(torch.zeros(2, 6, 4))
        layer.attn.q_b, layer.attn.kv = nn.Linear(5, 12, bias=False), nn.Linear(7, 4, bias=False)
        layer.norm.weight = nn.Parameter(torch.zeros(6))
        layer.router.bias = nn.Parameter(torch.zeros(2))
        with torch.no_grad():
            for n, p in self.named_parameters():
                p.copy_(_t(init[NAMES[n][0]], NAMES[n][1]))

    def get_output_embeddings(self):
        return self.head


def _cfg(**opt):
    o = {**FIX["optimizer"], "learning_rate": FIX["learning_rate"], "weight_decay": FIX["weight_decay"], **opt}
    return {"optimizer": o, "parallelism": {}}  # the pynative schema


def _no_key_warnings(caught):
    """The pynative keys are read: no "not read" / "not applied" warning names them (the level3 -> level1 one of
    data_parallel_shard stays)."""
    keys = ("ns_coefficients", "ns_steps", "comm_strategy", "qk_clip", "adamw_include", "use_fused_adamw", "eps=")
    said = [str(w.message) for w in caught]
    assert not [m for m in said if any(k in m for k in keys)], said


def _step(model, opt, step):
    for n, p in model.named_parameters():
        p.grad = _t(FIX["grads"][step][NAMES[n][0]], NAMES[n][1])
    opt.step()


def _worst(model, ref):
    """Error relative to each tensor's largest entry (test_muon.py's measure)."""
    out = 0.0
    for n, p in model.named_parameters():
        want = _t(ref[NAMES[n][0]], NAMES[n][1])
        out = max(out, ((p.detach() - want).abs().max() / want.abs().max()).item())
    return out


def _trajectory(model, opt):
    worst = []
    for step, ref in enumerate(FIX["trajectory"]):
        _step(model, opt, step)
        worst.append(_worst(model, ref))
    return worst


def test_build_optimizer_matches_mindspore():
    model = Toy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = msp.build_optimizer(model, _cfg())
    _no_key_warnings(caught)
    assert type(opt) is PynativeMuon and opt.ns_dtype == torch.bfloat16 and opt.ns_eps == 1e-7
    assert len(opt.ns_schedule) == FIX["meta"]["ns_steps"] == 10
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(NAMES[names[id(p)]][0] for g in opt.param_groups if g["use_muon"] for p in g["params"])
    assert muon == sorted(FIX["meta"]["muon"])
    opt.ns_dtype = torch.float32  # the fixture's iteration
    worst = _trajectory(model, opt)
    assert max(worst) <= RTOL, worst
    # the test can fail: the expert gate/up orthogonalised whole (no split), or the core Muon's 5 steps
    model = Toy()
    opt = msp.build_optimizer(model, _cfg())
    opt.ns_dtype = torch.float32
    del model.layers[0].experts.gate_up_proj.muon_gate_up_halves
    assert max(_trajectory(model, opt)) > 1e-3
    model = Toy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = msp.build_optimizer(model, {k: v for k, v in _cfg().items() if k != "parallelism"})
    assert type(opt) is Muon
    opt.ns_dtype = torch.float32
    assert max(_trajectory(model, opt)) > 1e-3


def test_newton_schulz_bf16_and_schedule():
    g = torch.tensor(FIX["grads"][0][MF + "self_attention.linear_q_up_proj.weight"])
    sched = ns_schedule(FIX["optimizer"]["ns_coefficients"])
    assert sched[:8] == ((3.4445, -4.775, 2.0315),) * 8 and sched[8:] == ((2.0, -1.5, 0.5),) * 2
    assert ns_schedule([3.4445, -4.775, 2.0315], 3) == ((3.4445, -4.775, 2.0315),) * 3
    bf16, fp32 = newton_schulz(g, sched), newton_schulz(g, sched, dtype=torch.float32)
    gap = ((bf16.float() - fp32).norm() / fp32.norm()).item()
    assert bf16.dtype == torch.bfloat16 and 0 < gap < 0.06, gap
    # the 8 + 2 schedule ends nearer orthogonal than 5 plain steps: singular values of X near 1
    sv = torch.linalg.svdvals(fp32)
    assert (sv - 1).abs().max() < 0.1, sv


def test_deepseek4_yaml_and_keys():
    cfg = msp.load_config(str(V4_YAML))
    from msparallel_ds.optim.build import optimizer_spec

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cls, kwargs = optimizer_spec(cfg)
    _no_key_warnings(caught)
    assert cls is PynativeMuon and ns_schedule(kwargs["ns_coefficients"]) == ns_schedule(
        [[[3.4445, -4.7750, 2.0315], 8], [[2.0, -1.5, 0.5], 2]]) and kwargs["eps"] == 1e-7
    assert kwargs["adamw_betas"] == (0.9, 0.95) and kwargs["lr"] == 1e-5
    # adamw_include replaces the default: the embedding (MindFormers' name matched) stays, the head goes to Muon
    model = Toy()
    opt = msp.build_optimizer(model, _cfg(adamw_include=["*word_embeddings*", "*.kv.*"]))
    names = {id(p): n for n, p in model.named_parameters()}
    adamw = {names[id(p)] for g in opt.param_groups if not g["use_muon"] for p in g["params"]}
    assert adamw == {"embed.weight", "layers.0.attn.kv.weight", "layers.0.norm.weight", "layers.0.router.bias"}
    for bad, key in (({"comm_strategy": "ring"}, "comm_strategy"), ({"ns_coefficients": [[1.0, 2.0], 3]},
                     "ns_coefficients"), ({"ns_coefficients": [[[1, 2, 3], 0]]}, "ns_coefficients"),
                     ({"adamw_include": [1]}, "adamw_include")):
        with pytest.raises(ValueError, match=f"optimizer.{key}="):
            msp.build_optimizer(Toy(), _cfg(**bad))


def _zero(rank, world, _):
    """PynativeMuon under Muon's whole-parameter ZeRO (zero_for_muon) over 2 ranks, against one process."""
    import torch.distributed as dist

    from msparallel_ds.optim.muon import zero_for_muon

    class Layout:  # what zero_for_muon reads: dp x cp of 2, no tp, no ep
        def size(self, dim):
            return {"dp_cp": world}.get(dim, 1)

        def group(self, dim):
            return dist.group.WORLD

    torch.set_num_threads(1)
    ref, model = Toy(), Toy()
    ref_opt, opt = msp.build_optimizer(ref, _cfg()), msp.build_optimizer(model, _cfg())
    ref_opt.ns_dtype = opt.ns_dtype = torch.float32
    opt = zero_for_muon(opt, Layout(), {"zero_optimization": {"stage": 1}})
    local = opt.optim
    owned = sum(p.numel() for g in local.param_groups for p in g["params"])
    for step in range(3):
        _step(ref, ref_opt, step)
        _step(model, opt, step)
    diff = max(((a - b).abs().max() / b.abs().max()).item()
               for a, b in zip(model.parameters(), ref.parameters()))
    return {"type": type(local).__name__, "owned": owned, "diff": diff,
            "halves": getattr(model.layers[0].experts.gate_up_proj, "muon_gate_up_halves", False),
            "tp": _tp(rank, world)}


def _tp(rank, world):
    """Tensor parallel over the 2 ranks: a fused expert gate_up split per half on its dim 1 (gathered, then its two
    halves orthogonalised apart) and a column-split matrix, against the unsharded PynativeMuon."""
    import torch.distributed as dist

    from msparallel_ds.tensor_parallel.spec import Shard

    gen = torch.Generator().manual_seed(3)
    shards = {"gate_up": Shard(1, "split", parts=2), "col": Shard(0, "split")}
    full = {"gate_up": torch.randn(2, 8, 6, generator=gen), "col": torch.randn(12, 5, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in full.items()} for _ in range(3)]
    whole = {k: nn.Parameter(v.clone()) for k, v in full.items()}
    local = {k: shards[k].parameter(shards[k].local(v, world, rank).clone()) for k, v in full.items()}
    whole["gate_up"].muon_gate_up_halves = local["gate_up"].muon_gate_up_halves = True

    def muon(params, group=None):
        return PynativeMuon([{"params": params, "use_muon": True}], lr=0.05, weight_decay=0.1,
                            ns_dtype=torch.float32, tp_group=group,
                            ns_coefficients=FIX["optimizer"]["ns_coefficients"])

    opts = [muon(list(whole.values())), muon(list(local.values()), dist.group.WORLD)]
    for g in grads:
        for k in full:
            whole[k].grad, local[k].grad = g[k].clone(), shards[k].local(g[k], world, rank).clone()
        for o in opts:
            o.step()
    return {k: ((local[k].detach() - shards[k].local(whole[k].detach(), world, rank)).abs().max()
                / whole[k].detach().abs().max()).item() for k in full}


def test_zero_and_tp_match_one_process():
    out = run_distributed(_zero, 2, None, timeout=120)
    total = sum(p.numel() for p in Toy().parameters())
    assert all(r["type"] == "PynativeMuon" and r["halves"] for r in out)
    assert sum(r["owned"] for r in out) == total and all(0 < r["owned"] < total for r in out)
    assert all(r["diff"] <= 1e-6 for r in out), out
    assert all(v <= 1e-6 for r in out for v in r["tp"].values()), [r["tp"] for r in out]
