"""optimizer.type: Muon under tensor parallel: each tp-split matrix's Nesterov input is all-gathered over tp along its
shard dim (a fused [gate; up] block by block), Newton-Schulz runs on the whole matrix, the step is scaled by the
whole shape and each rank keeps its slice (MindFormers 2.1 core/optim/muon.py _perform_allgather_op /
_slice_tensor_to_shards). One run_distributed on 4 gloo processes:

- a tiny Llama at tp2 x dp2, optimizer parallel level1 (Muon's whole-parameter ZeRO), the YAML's Muon, 3 steps,
  against one process on the global batch (Newton-Schulz in float32 on both sides, as test_muon.py); its checkpoint
  after step 1 (the tp-split momentum slices) resumed at dp2 x cp2 gives steps 2 and 3's losses;
- a tiny DeepSeek-V3 at dp2 x tp2 (sequence parallel) x ep2 with level1 (SplitZero: dense states over dp, experts'
  over expert dp): q_b_proj / kv_b_proj split per head, routed experts whole (not gathered);
- split parameters alone (column, row, fused [gate; up] and [q | k | v] cut part by part) over two tp groups against the
  unsharded Muon, and the per-shard Newton-Schulz (what tp without the gather would do) measured as far off;
- a split matrix without a tp group, and tp peers whose ZeRO shards differ: clear errors."""
import warnings

import torch

from deepseek_cases import deepseek_model
from engine_cases import global_batch, tiny_config, tiny_model
from harness import run_distributed
from moe_cases import ep_yaml

STEPS, RTOL = 3, 1e-5
MUON = {"type": "Muon", "learning_rate": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
        "matched_adamw_rms": 0.2, "adamw_betas": [0.9, 0.95], "adamw_eps": 1e-8}


def _cfg(ep=None, **layout):
    cfg = tiny_config(clip=0, **layout) if ep is None else ep_yaml(ep=ep, clip=0, **layout)
    cfg["optimizer"] = dict(MUON)
    return cfg


CASES = {  # name -> (model factory, layout); the reference is the same YAML at dp = tp = ep = 1
    "llama_dp2xtp2_zero1": (tiny_model, dict(dp=2, tp=2, zero=1)),
    "deepseek_v3_dp2xtp2_sp_ep2_zero1": (lambda: deepseek_model(num_hidden_layers=2),
                                         dict(dp=2, tp=2, sp=True, zero=1, ep=2)),
}


def _local_muons(opt):
    """The Muon(s) doing the work behind ZeroRedundancyOptimizer / SplitZero."""
    from msparallel_ds.optim.muon import Muon

    parts = getattr(opt, "parts", [opt])
    return [m for m in (getattr(p, "optim", p) for p in parts) if isinstance(m, Muon)]


def _rel(a, b):
    """Error relative to the tensor's largest entry (test_muon.py's measure)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _engine(make, layout):
    import msparallel_ds as msp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = msp.initialize(make(), msp.load_config(_cfg(**layout)))
    muons = _local_muons(engine.ds.optimizer)
    for m in muons:
        m.ns_dtype = torch.float32
    return engine, muons


def _train(rank, name, root):
    import msparallel_ds as msp

    make, layout = CASES[name]
    engine, muons = _engine(make, layout)
    lay = engine.layout
    rows, dp, d = engine.micro_batch_size * engine.gradient_accumulation_steps, lay.size("dp"), lay.rank("dp")
    from msparallel_ds.optim.muon import _tp_shard

    split = sorted(n for n, p in engine.model.named_parameters() if _tp_shard(p, muons[0].tp_group) is not None)
    losses = []
    for step in range(STEPS):
        if step == STEPS - 2 and root:
            engine.save(root, sharded=True)
        ids, labels = global_batch(step, rows * dp)
        share = slice(d * rows, (d + 1) * rows)
        losses.append(engine.train_batch({"input_ids": ids[share], "labels": labels[share]}).item())
    state = engine.full_state_dict()
    out = {"optimizer": type(engine.ds.optimizer).__name__, "tp_group": [m.tp_group is not None for m in muons],
           "split": split, "losses": losses}
    if root:  # the last 2 steps again from the checkpoint, at dp2 x cp2 (tp 1: the momentum slices put together)
        other, _ = _engine(make, dict(dp=2, cp=2, zero=1))
        other.load(root)
        lay, out["resumed"] = other.layout, []
        for step in range(STEPS - 2, STEPS):
            ids, labels = global_batch(step, rows * dp)
            share = slice(lay.rank("dp") * rows, (lay.rank("dp") + 1) * rows)
            out["resumed"].append(other.train_batch({"input_ids": ids[share], "labels": labels[share]}).item())
    if rank != list(CASES).index(name):  # each case's reference on its own rank, in parallel
        return out
    model = make()
    opt = msp.build_optimizer(model, msp.load_config(_cfg(ep=1 if "ep" in layout else None)))
    opt.ns_dtype = torch.float32
    ref_losses = []
    for step in range(STEPS):
        ids, labels = global_batch(step, rows * dp)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    ref = model.state_dict()
    start = make().state_dict()
    out.update(ref_losses=ref_losses, worst={k: _rel(state[k], v) for k, v in ref.items()},
               moved=max(_rel(v, start[k]) for k, v in ref.items()))
    return out


def _shards(rank):
    """Column (dim 0), row (dim 1), fused [gate; up] (dim 0, 2 parts: GLM's gate_up_proj) and fused [q | k | v]
    (dim 1, 3 parts: GPT-2's Conv1D c_attn) matrices over tp groups {0, 1}, {2, 3}."""
    import torch.distributed as dist

    from msparallel_ds.optim.muon import Muon
    from msparallel_ds.tensor_parallel.spec import Shard

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp_group, t = groups[rank // 2], rank % 2
    shards = {"col": Shard(0, "split"), "row": Shard(1, "split"), "gate_up": Shard(0, "split", parts=2),
              "qkv": Shard(1, "split", parts=3)}
    gen = torch.Generator().manual_seed(7)
    full = {"col": torch.randn(12, 6, generator=gen), "row": torch.randn(6, 10, generator=gen),
            "gate_up": torch.randn(16, 5, generator=gen), "qkv": torch.randn(5, 18, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in full.items()} for _ in range(STEPS)]

    def muon(params, group=None):
        return Muon([{"params": params, "use_muon": True}], lr=0.05, weight_decay=0.1, ns_dtype=torch.float32,
                    tp_group=group)

    whole = {k: torch.nn.Parameter(v.clone()) for k, v in full.items()}
    local = {k: shards[k].parameter(shards[k].local(v, 2, t).clone()) for k, v in full.items()}
    naive = {k: torch.nn.Parameter(p.detach().clone()) for k, p in local.items()}  # per-shard Newton-Schulz
    opts = [muon(list(whole.values())), muon(list(local.values()), tp_group), muon(list(naive.values()))]
    for g in grads:
        for k in full:
            whole[k].grad = g[k].clone()
            local[k].grad = naive[k].grad = shards[k].local(g[k], 2, t).clone()
        for o in opts:
            o.step()
    out = {"worst": {k: _rel(local[k].detach(), shards[k].local(whole[k].detach(), 2, t)) for k in full},
           "naive": {k: _rel(naive[k].detach(), shards[k].local(whole[k].detach(), 2, t)) for k in full}}
    try:
        muon([local["col"]]).step()
        out["no_group"] = "accepted"
    except ValueError as e:
        out["no_group"] = str(e)
    from types import SimpleNamespace

    from msparallel_ds.optim.muon import _check_tp_peers

    stub = SimpleNamespace(device_type="cpu", size=lambda name: 2, rank=lambda name: t)
    _check_tp_peers(muon(list(local.values()), tp_group), stub)  # the same split matrices: passes
    try:  # tp rank 1 holding one split matrix more than rank 0 (a ZeRO partition that differed): refused
        _check_tp_peers(muon(list(local.values())[:3 + t], tp_group), stub)
        out["peers"] = "accepted"
    except ValueError as e:
        out["peers"] = str(e)
    return out


def _run(rank, world, root):
    return {**{name: _train(rank, name, root if name.startswith("llama") else None) for name in CASES},
            "shards": _shards(rank)}


def test_muon_under_tp_matches_one_process(tmp_path):
    results = run_distributed(_run, 4, str(tmp_path / "ckpt"), timeout=180)
    for rank, res in enumerate(results):
        shards = res["shards"]
        assert max(shards["worst"].values()) <= RTOL, (rank, shards)
        assert min(shards["naive"].values()) > 100 * RTOL, (rank, shards)  # the gather is what makes them agree
        assert "split over tensor parallel but no tp group" in shards["no_group"], shards
        assert "ZeRO shards hold different split matrices" in shards["peers"], shards
        for name in CASES:
            run, ref = res[name], results[list(CASES).index(name)][name]
            assert run["tp_group"] and all(run["tp_group"]), (name, rank, run)
            rel = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["ref_losses"]))
            assert rel <= RTOL, (name, rank, run["losses"], ref["ref_losses"])
        resumed = res["llama_dp2xtp2_zero1"]  # the second resumed loss follows a step that read the saved state
        rel = max(abs(a - b) / b for a, b in zip(resumed["resumed"], resumed["losses"][-2:]))
        assert rel <= RTOL, (rank, resumed["resumed"], resumed["losses"])
    llama, ds = results[0]["llama_dp2xtp2_zero1"], results[0]["deepseek_v3_dp2xtp2_sp_ep2_zero1"]
    assert llama["optimizer"] == "ZeroRedundancyOptimizer" and ds["optimizer"] == "SplitZero", (llama, ds)
    assert {"model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"} <= set(llama["split"])
    assert {"model.layers.0.self_attn.q_b_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight"} <= set(ds["split"])
    assert not [n for n in ds["split"] if "experts" in n], ds["split"]  # whole experts (split over ep): no tp gather
    for name in CASES:
        r0 = results[list(CASES).index(name)][name]
        assert max(r0["worst"].values()) <= RTOL, (name, sorted(r0["worst"].items(), key=lambda kv: -kv[1])[:5])
        assert r0["moved"] > 1e-2, (name, r0["moved"])  # Muon moved the weights well past the tolerance
