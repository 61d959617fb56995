"""DeepSeek-V3 (MLA + DeepSeek MoE + multi-token prediction) through msp.initialize on 4 gloo processes equals one
process on the whole global batch: per-step LM losses over 3 AdamW steps (relative error <= 1e-4 on every rank),
final weights (experts gathered over ep, heads over tp), the true global gradient norm, and where on, the MTP
cross-entropy and the aux loss. Group "a" holds the four layouts issue 21 names with only parallel_config set
(each rank holding 1/ep of the experts) plus a dense MLA model under tp without sequence parallel; group "b" adds
MTP (MindFormers mcore keys), the aux-loss-free expert-bias update, the sequence aux loss, and a save_pretrained /
from_pretrained round trip of the MTP weights. Pipeline + optimizer parallel + ep (pipeline.zero: dense states sharded
over dp x cp, expert states over edp): pp2 x dp2 x ep2 in group "a" (edp 1) and pp2 x dp4 x ep2 on 8 processes in
group "c" (edp 2).
"""
import pytest
from deepseek_cases import deepseek_model, deepseek_reference
from engine_cases import global_batch
from harness import run_distributed
from moe_cases import adamw as _adamw
from moe_cases import accelerate_steps, ep_yaml

pytestmark = pytest.mark.distributed

STEPS, CLIP, RATE, MTP_SCALE, AUX = 3, 0.05, 0.01, 0.3, 0.01
BIAS = dict(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=RATE)
LAYOUTS = {  # name -> tiny_config kwargs + ep / pp / mtp / MoE keys
    "dp4_ep4": dict(dp=4, zero=1, ep=4),
    "dp2xtp2_sp_ep2": dict(dp=2, tp=2, sp=True, zero=1, ep=2),
    "dp2xcp2_ring_ep2": dict(dp=2, cp=2, ring=True, zero=2, ep=2),
    "pp2xdp2_ep2": dict(dp=2, zero=0, ep=2, pp=2),
    "pp2xdp2_ep2_zero1": dict(dp=2, zero=1, ep=2, pp=2),  # optimizer parallel: dense over dp, experts over edp (1)
    "pp2xdp4_ep2_zero1": dict(dp=4, zero=1, ep=2, pp=2),  # 8 processes: expert states sharded over edp = 2
    "dense_dp2xtp2_no_sp": dict(dp=2, tp=2, zero=1, ep=1, dense=True),
    "dp4_ep4_mtp": dict(dp=4, zero=1, ep=4, mtp=1),
    "dp2xtp2_sp_ep2_mtp_bias": dict(dp=2, tp=2, sp=True, zero=2, ep=2, mtp=1, moe=BIAS),
    "dp2xcp2_ulysses_ep2_mtp": dict(dp=2, cp=2, algo="ulysses_cp", zero=1, ep=2, mtp=1),
    "dp4_ep2_mtp_legacy": dict(dp=4, zero=1, ep=2, mtp=1, legacy=True),
    "pp2xdp2_ep2_bias": dict(dp=2, zero=0, ep=2, pp=2, moe=BIAS),
    "dp4_ep2_seq_aux_bias_recompute": dict(dp=4, zero=0, ep=2, recompute=True, moe=dict(
        moe_aux_loss_coeff=AUX, moe_router_load_balancing_type="seq_aux_loss", **BIAS)),
}
GROUPS = {"a": ["dp4_ep4", "dp2xtp2_sp_ep2", "dp2xcp2_ring_ep2", "pp2xdp2_ep2", "dense_dp2xtp2_no_sp",
                "pp2xdp2_ep2_zero1"],
          "b": ["dp4_ep4_mtp", "dp2xtp2_sp_ep2_mtp_bias", "dp2xcp2_ulysses_ep2_mtp", "pp2xdp2_ep2_bias",
                "dp4_ep2_seq_aux_bias_recompute", "dp4_ep2_mtp_legacy"],
          "c": ["pp2xdp4_ep2_zero1"]}
WORLD = {"c": 8}
DENSE = dict(first_k_dense_replace=4)  # every layer dense: MLA alone (MoE with tp > 1 requires sequence parallel)


def ds_yaml(mtp=0, legacy=False, dense=False, **kw):
    """ep_yaml plus MTP in MindFormers 2.x (mcore) spellings, or the legacy ones (`dense`: the model, not the YAML)."""
    y = ep_yaml(clip=CLIP, **kw)
    if mtp and legacy:
        y["model"]["model_config"].update(mtp_depth=mtp, mtp_loss_factor=MTP_SCALE)
    elif mtp:
        y["use_legacy"] = False
        y["model"]["model_config"].update(mtp_num_layers=mtp, mtp_loss_scaling_factor=MTP_SCALE)
    return y


def _train(name, save_dir=None):
    import msparallel_ds as msp

    kw = LAYOUTS[name]
    model = deepseek_model(mtp=kw.get("mtp", 0), **(DENSE if kw.get("dense") else {}))
    engine = msp.initialize(model, msp.load_config(ds_yaml(**kw)), optimizer=_adamw)
    rows, lay = engine.micro_batch_size * engine.gradient_accumulation_steps, engine.layout
    losses, norms, mtp, aux = [], [], [], []
    for step in range(STEPS):
        ids, labels = global_batch(step, rows * lay.size("dp"))
        share = slice(lay.rank("dp") * rows, (lay.rank("dp") + 1) * rows)
        losses.append(engine.train_batch({"input_ids": ids[share], "labels": labels[share]}).item())
        norms.append(getattr(engine, "global_grad_norm", None))  # both engines report it (None without clipping)
        mtp.append(getattr(engine, "last_mtp_loss", None))
        aux.append(getattr(engine, "last_aux_loss", None))
    out = {"losses": losses, "norms": norms, "mtp": mtp, "aux": aux, "rows": rows * lay.size("dp"),
           "state": engine.full_state_dict(rank0_only=True), "pp": lay.size("pp"),
           "experts": sum(p.numel() for n, p in engine.model.named_parameters() if ".experts." in n),
           "moe_layers": len({n.split(".experts.")[0] for n, _ in engine.model.named_parameters() if ".experts." in n})}
    out["opt"] = type(engine.optimizer).__name__
    if save_dir:  # the MTP layer saved under HF DeepSeek-V3's names, loaded back by msp.from_pretrained
        engine.save_pretrained(f"{save_dir}/hf")
        back = msp.from_pretrained(f"{save_dir}/hf", msp.init_parallel(msp.load_config(ds_yaml(**kw))))
        name_ = "model.layers.4.eh_proj.weight"
        full = out["state"][name_] if out["state"] else None
        local = dict(back.named_parameters())[name_].detach()
        out["reloaded"] = (local.shape, None if full is None else float((full - local).abs().max()),
                           sorted(k for k in back.state_dict() if k.startswith("model.layers.4.enorm")))
    return out


def _run_group(rank, world_size, names, save_dir):
    import torch

    torch.set_num_threads(1)
    return {name: _train(name, save_dir if name == "dp4_ep4_mtp" else None) for name in names}


_REFS = {}


def _reference(name, rows):
    kw = LAYOUTS[name]
    moe = kw.get("moe") or {}
    key = (rows, kw.get("mtp", 0), bool(moe.get("moe_router_enable_expert_bias")), moe.get("moe_aux_loss_coeff", 0.0),
           bool(kw.get("dense")), bool(kw.get("legacy")))
    if key not in _REFS:
        _REFS[key] = deepseek_reference(STEPS, rows, clip=CLIP, bias_rate=RATE if key[2] else None,
                                        mtp=(key[1], MTP_SCALE, key[5]) if key[1] else None, aux=key[3],
                                        **(DENSE if kw.get("dense") else {}))
    return _REFS[key]


PARITY = {}


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_deepseek_v3_matches_single_process(group, tmp_path):
    results = run_distributed(_run_group, WORLD.get(group, 4), GROUPS[group], str(tmp_path), timeout=600)
    for name in GROUPS[group]:
        kw, r0 = LAYOUTS[name], results[0][name]
        ref_losses, ref_state, ref_norms, ref_mtp, ref_aux = _reference(name, r0["rows"])
        total_experts = sum(v.numel() for k, v in ref_state.items() if ".experts." in k)
        rel, mrel, arel = 0.0, 0.0, 0.0
        for rank, res in enumerate(results):
            r = res[name]
            rel = max(rel, max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses)))
            assert rel <= 1e-4, (name, rank, r["losses"], ref_losses)
            if total_experts:  # each rank holds 1/ep of the routed experts of its stage's MoE layers
                moe_layers = len({k.split(".experts.")[0] for k in ref_state if ".experts." in k})
                assert r["experts"] * kw["ep"] * moe_layers == total_experts * r["moe_layers"], (name, rank)
            if r["norms"][0] is not None:
                assert max(abs(a - b) / b for a, b in zip(r["norms"], ref_norms)) <= 1e-5, (name, r["norms"])
            if ref_mtp:
                mrel = max([mrel] + [abs(a - b) / b for a, b in zip(r["mtp"], ref_mtp)])
                assert mrel <= 1e-4, (name, r["mtp"], ref_mtp)
            if ref_aux:  # the sequence aux loss (sigmoid scores normalised), logged apart
                arel = max([arel] + [abs(a - b) / b for a, b in zip(r["aux"], ref_aux)])
                assert arel <= 1e-4, (name, r["aux"], ref_aux)
        assert min(ref_norms) > CLIP  # clipping scaled every step
        state = r0["state"]
        assert set(state) == set(ref_state), sorted(set(state) ^ set(ref_state))
        werr = max((state[k] - v).abs().max().item() for k, v in ref_state.items())
        assert werr <= 5e-5, (name, werr)
        if (kw.get("moe") or {}).get("moe_router_enable_expert_bias"):  # the balancing moved the biases
            start = deepseek_model().state_dict()["model.layers.1.mlp.gate.e_score_correction_bias"]
            moved = (state["model.layers.1.mlp.gate.e_score_correction_bias"] - start).abs().max().item()
            assert 0 < moved <= STEPS * RATE + 1e-6, moved
        PARITY[name] = (rel, werr, mrel, arel)
        if kw.get("pp", 1) > 1 and kw.get("zero"):  # dense states over dp, experts over edp (= 1 here: whole)
            assert all(res[name]["opt"] == "SplitZero" for res in results)
        if "reloaded" in r0:
            shape, err, keys = r0["reloaded"]
            assert err is not None and err == 0.0 and keys == ["model.layers.4.enorm.weight"], r0["reloaded"]
    print({k: tuple(f"{x:.1e}" for x in v) for k, v in PARITY.items()})


def test_mla_tp_plan_and_mtp_errors():
    """MLA's tp plan (down projections replicated with tp-summed grads, up projections split with their input taken
    once by the block), and MTP refused where it does not run yet, with the YAML key named."""
    from types import SimpleNamespace

    from msparallel_ds.models import adapter_for
    from msparallel_ds.strategy import Options, parallelize_part

    model = deepseek_model()
    adapter = adapter_for(model)
    plan = adapter.tp_plan(model.config, 2, sequence_parallel=True)
    attn = "model.layers.*.self_attn"
    assert plan[attn] == "sequence_gather_input" and plan[f"{attn}.q_a_proj"] == "replicated_with_grad_allreduce"
    assert plan[f"{attn}.kv_b_proj"] == "colwise_gathered" and plan[f"{attn}.o_proj"] == "rowwise"
    dense = deepseek_model(**DENSE)
    assert adapter.tp_plan(dense.config, 2, sequence_parallel=False)[attn] == "copy_input"
    assert adapter.tp_plan(model.config, 2, sequence_parallel=False)["model.layers.1.mlp"] == "token_slice_block"
    copies = SimpleNamespace(size=lambda n: 1, plan=SimpleNamespace(micro_batch_interleave_num=2))
    with pytest.raises(ValueError, match="mtp_depth=1 with micro_batch_interleave_num=2"):
        parallelize_part(deepseek_model(), copies, Options(mtp_depth=1, mtp_scale=0.3))


def _accelerate_bias(rank, world_size):
    """HF-style loop under MindFormersAccelerator (DeepSpeed ZeRO-2) with dp4 x ep2 and the expert-bias update; then
    an MTP YAML, which this path refuses."""
    import msparallel_ds as msp
    from msparallel_ds.strategy import prepare_user_loop

    model, losses, _ = accelerate_steps(ds_yaml(dp=4, zero=2, ep=2, moe=BIAS), deepseek_model(), STEPS)
    bias = next(b for n, b in model.named_buffers() if n.endswith("layers.1.mlp.gate.e_score_correction_bias")).clone()
    mtp_model = deepseek_model(mtp=1)  # what prepare() checks right after parallelizing (one Accelerator per process)
    msp.parallelize(mtp_model, msp.init_parallel(msp.load_config(ds_yaml(dp=4, zero=2, ep=2, mtp=1))))
    try:
        prepare_user_loop(mtp_model, None)
        refused = None
    except ValueError as e:
        refused = str(e)
    return {"losses": losses, "bias": bias, "refused": refused}


@pytest.mark.distributed
def test_accelerate_applies_the_expert_bias_update():
    results = run_distributed(_accelerate_bias, 4, timeout=300)
    ref_losses, ref_state = deepseek_reference(STEPS, 4, clip=CLIP, bias_rate=RATE)[:2]
    for r in results:
        assert max(abs(a - b) / b for a, b in zip(r["losses"], ref_losses)) <= 1e-4, (r["losses"], ref_losses)
        assert (r["bias"] - ref_state["model.layers.1.mlp.gate.e_score_correction_bias"]).abs().max() <= 1e-7
        assert r["refused"] and "mtp_depth=1" in r["refused"] and "msp.initialize" in r["refused"], r["refused"]
