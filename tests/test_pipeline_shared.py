"""The word embedding shared across pipeline stages (pipeline.shared, Megatron's embedding group) and multi-token
prediction under pipeline parallel, on 4 gloo processes against one process.

GPT-2 with its tied head: pp2 x dp2 (1F1B, ZeRO-1) and pp2 x tp2 + SP zero_bubble_v (first and last stage on one
rank: one vocab-parallel parameter again after tp; interleaved pp2 x dp2 is test_families'), 3 AdamW
steps with global-norm clipping: losses <= 1e-6 relative, the global grad norm (the shared weight counted once)
<= 1e-6, weights <= 1e-5; engine.save (single file and sharded) writes the embedding once and engine.load fills
both copies.
DeepSeek-V3 with MTP from the real flagship YAMLs scaled (the way tests/test_real_configs.py scales them):
pp2 x tp2 + SP x ep2 with optimizer parallel, seqpipe run as 1F1B (pretrain 671B), and its interleaved / ZB-V
variants; LM loss, MTP loss, global grad norm and every weight (the router expert bias included) against one process.
One spawned run covers every case.
"""
from pathlib import Path

import pytest
from deepseek_cases import deepseek_model, deepseek_reference
from engine_cases import global_batch, tiny_config, train_steps
from family_cases import BETAS, EPS, LR, tiny_family
from harness import run_distributed
from moe_cases import adamw as ds_adamw

pytestmark = pytest.mark.distributed

STEPS, CLIP = 3, 0.3
GPT2 = {  # name -> (tiny_config kwargs, pp_interleave_num, scheduler)
    "gpt2_pp2xdp2_zero1": (dict(dp=2, zero=1), 1, "1f1b"),
    "gpt2_pp2xtp2_sp_vocab_zbv": (dict(tp=2, sp=True, zero=0), 2, "zero_bubble_v"),
}


def _gpt2_config(name):
    kw, vpp, sched = GPT2[name]
    c = tiny_config(clip=CLIP, **kw)
    c["parallel_config"].update(pipeline_stage=2, micro_batch_num=4)
    c["parallel"]["pipeline_config"] = {"pipeline_interleave": vpp > 1, "pipeline_scheduler": sched}
    c["model"]["model_config"]["pp_interleave_num"] = vpp
    return c


HERE = Path(__file__).resolve().parent
SHARED = Path(__file__).resolve().parents[2] / "shared" / "mindformers-configs"
# name -> (YAML, scheduler, pp_interleave_num): the two 671B YAMLs (legacy MTP keys mtp_depth / mtp_loss_factor:
# MindFormers' legacy MTP) and the 2.1 12B one (mcore keys num_nextn_predict_layers / mtp_loss_scaling_factor)
FLAGSHIPS = {
    "ds3_671b_pretrain_seqpipe": (SHARED / "deepseek3__pretrain_deepseek3_671b.yaml", "seqpipe", 1),
    "ds3_671b_finetune_interleaved": (SHARED / "deepseek3__finetune_deepseek3_671b.yaml", "1f1b", 2),
    "ds3_12b_pp16_zero_bubble_v": (HERE / "fixtures" / "mindformers21" / "pretrain_deepseek3_12b_16p_pp16.yaml",
                                   "zero_bubble_v", 2),
}
_TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
             num_heads=4, num_attention_heads=4, n_kv_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=16, v_head_dim=16, vocab_size=256, seq_length=32, max_position_embeddings=32,
             num_layers=4, num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2)


def flagship_yaml(name):
    """The real YAML scaled to 4 processes and the tiny DeepSeek-V3: pp2 x tp2 + SP x ep2 (dp 1), optimizer parallel
    on, micro_batch_num 4, its MTP, routing, expert-bias and sequence aux-loss keys kept; the sizes the tiny model's;
    per-stage recompute lists cut to 2 stages; the legacy capacity set to every token and the legacy expert aux loss
    off (the reference is dropless without them); no lr schedule (constant lr, as the reference)."""
    import yaml

    path, sched, vpp = FLAGSHIPS[name]
    y = yaml.safe_load(path.read_text())
    y["parallel_config"].update(data_parallel=1, model_parallel=2, pipeline_stage=2, expert_parallel=2,
                                micro_batch_num=4, use_seq_parallel=True)
    par = y.setdefault("parallel", {})
    par["enable_parallel_optimizer"] = True
    par["pipeline_config"] = {"pipeline_interleave": vpp > 1, "pipeline_scheduler": sched}
    mc = y["model"]["model_config"]
    # legacy MindFormers counts the MTP layer in the last stage's share (4 + 1 layers): the remainder goes there
    last = ([0, 1] if vpp == 1 else [[0, 0], [0, 1]]) if "mtp_depth" in mc else 0
    mc.update({k: v for k, v in _TINY.items() if k in mc}, offset=last, pp_interleave_num=vpp)
    mc.update(compute_dtype="float32", param_init_type="float32")
    moe = y.get("moe_config") or {}
    for key in ("aux_loss_factor", "aux_loss_factors", "aux_loss_types"):
        moe.pop(key, None)
    if moe:  # capacity = ceil(k x tokens x 4 / E) = every token: the capacity path runs, nothing is dropped
        moe["capacity_factor"] = 4.0
    moe.update({k: v for k, v in dict(expert_num=8, num_experts_chosen=2, moe_intermediate_size=32,
                                      first_k_dense_replace=1).items() if k in moe})
    rec = y.get("recompute_config") or {}
    if isinstance(rec.get("recompute"), list):
        rec["recompute"] = [min(x, 1) for x in rec["recompute"][:2]]
    y.pop("lr_schedule", None)
    y["optimizer"] = {"type": "AdamW", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0, "learning_rate": 1e-3}
    y["runner_config"]["batch_size"] = 1
    return y


def _flagship_reference_args(y):
    """deepseek_reference's arguments for a scaled YAML: MTP (depth, scale, legacy), the expert-bias rate, the
    sequence aux-loss coefficient and the routed scaling factor."""
    mc, moe = y["model"]["model_config"], y.get("moe_config") or {}
    legacy = "mtp_depth" in mc
    mtp = (mc["mtp_depth"], mc["mtp_loss_factor"], True) if legacy else \
        (mc["num_nextn_predict_layers"], mc["mtp_loss_scaling_factor"], False)
    rate = moe.get("topk_bias_update_rate") if moe.get("balance_via_topk_bias") else \
        (mc.get("moe_router_bias_update_rate") if mc.get("moe_router_enable_expert_bias") else None)
    aux = mc.get("moe_aux_loss_coeff", 0.0) if mc.get("moe_router_load_balancing_type") == "seq_aux_loss" else 0.0
    scaling = mc.get("routed_scaling_factor", moe.get("routed_scaling_factor", 2.5))
    return dict(mtp=mtp, bias_rate=rate, aux=aux, routed_scaling_factor=scaling)


def _flagship(name):
    import msparallel_ds as msp

    y = flagship_yaml(name)
    args = _flagship_reference_args(y)
    model = deepseek_model(mtp=args["mtp"][0], routed_scaling_factor=args["routed_scaling_factor"])  # as the reference
    engine = msp.initialize(model, msp.load_config(y), optimizer=ds_adamw)
    out = _steps(engine, global_batch)
    out["state"] = engine.full_state_dict(rank0_only=True)
    out["sizes"] = {n: engine.layout.size(n) for n in ("pp", "dp", "tp", "ep", "edp")}
    out["opt"] = type(engine.optimizer).__name__
    out["sp"] = engine.applied.sequence_parallel
    out["mtp_on_last"] = [s.submod.mtp is not None for s in engine.stages]
    out["stage_ids"] = list(engine.stage_ids)
    return out


def _adamw(params):
    import torch

    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)


def _steps(engine, batch_of, n=STEPS):
    return train_steps(engine, n, batch_of, norms=lambda e: e.global_grad_norm, mtp=lambda e: e.last_mtp_loss)


def _gpt2(name, save_dir):
    import torch

    import msparallel_ds as msp

    cfg = msp.load_config(_gpt2_config(name))
    engine = msp.initialize(tiny_family("gpt2", tied=True), cfg, optimizer=_adamw)
    out = _steps(engine, global_batch)
    out["state"] = engine.full_state_dict(rank0_only=True)
    shared = engine.shared
    out["shared"] = None if shared is None else (shared.param.shape, dict(shared.aliases),
                                                 bool(getattr(shared.param, "shared_embedding", False)))
    out["stage_ids"] = list(engine.stage_ids)
    view = engine.model  # a rank holding both ends: the head reads the embedding's (vocab-parallel) parameter
    out["one_param"] = (view.lm_head is not None and view.transformer.wte is not None
                        and view.lm_head.weight is view.transformer.wte.weight)
    if name == "gpt2_pp2xdp2_zero1":  # saved once, loaded into both copies of a fresh engine
        engine.save(f"{save_dir}/{name}", sharded=False)  # the single file (msp_universal.pt)
        again = msp.initialize(tiny_family("gpt2", tied=True), cfg, optimizer=_adamw)
        again.load(f"{save_dir}/{name}")
        mine = dict(engine.model.named_parameters())
        out["reload_err"] = max(float((p - mine[n]).detach().abs().max()) for n, p in again.model.named_parameters())
        engine.save(f"{save_dir}/{name}_sharded", sharded=True)  # the sharded (DCP) save: the same rule
        third = msp.initialize(tiny_family("gpt2", tied=True), cfg, optimizer=_adamw)
        third.load(f"{save_dir}/{name}_sharded")
        out["reload_err"] = max([out["reload_err"]] + [float((p - mine[n]).detach().abs().max())
                                                       for n, p in third.model.named_parameters()])
        out["saved_keys"] = sorted(torch.load(f"{save_dir}/{name}/{_file()}", weights_only=True)["params"]) \
            if engine.layout.global_rank == 0 else None
    return out


def _file():
    from msparallel_ds.checkpoint.format import FILE

    return FILE


def _run(rank, world_size, save_dir):
    import torch

    torch.set_num_threads(1)
    out = {name: _gpt2(name, save_dir) for name in GPT2}
    out.update({name: _flagship(name) for name in FLAGSHIPS})
    return out


def _gpt2_reference(rows):
    import torch

    model = tiny_family("gpt2", tied=True)
    opt = _adamw(model.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        ids, labels = global_batch(step, rows)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_shared_embedding_and_mtp_match_single_process(tmp_path):
    results = run_distributed(_run, 4, str(tmp_path), timeout=600)
    refs, table = {}, {}
    for name in GPT2:
        r0 = results[0][name]
        if r0["rows"] not in refs:
            refs[r0["rows"]] = _gpt2_reference(r0["rows"])
        ref_losses, ref_norms, ref_state = refs[r0["rows"]]
        assert min(ref_norms) > CLIP  # clipping scaled every step
        for rank, res in enumerate(results):
            r = res[name]
            assert _rel(r["losses"], ref_losses) <= 1e-6, (name, rank, r["losses"], ref_losses)
            assert _rel(r["norms"], ref_norms) <= 1e-6, (name, rank, r["norms"], ref_norms)
        state = r0["state"]
        assert set(state) == set(ref_state), sorted(set(state) ^ set(ref_state))
        assert state["lm_head.weight"] is state["transformer.wte.weight"]  # one tensor, as HF's state dict
        werr = max((state[k] - v).abs().max().item() for k, v in ref_state.items())
        assert werr <= 1e-5, (name, werr)
        ends = [res[name]["shared"] for res in results]
        if GPT2[name][2] == "zero_bubble_v":  # both stages on pp rank 0: one parameter, nothing to sum
            assert results[0][name]["stage_ids"] == [0, 3] and ends == [None] * 4, ends
            assert [res[name]["one_param"] for res in results] == [True, True, False, False]
        else:  # pp rank 0 holds the embedding, pp rank 1 the marked copy under the head's name
            assert [e[1:] for e in ends] == [({}, False)] * 2 + [({"lm_head.weight": "transformer.wte.weight"},
                                                                   True)] * 2, ends
        if "reload_err" in r0:
            assert all(res[name]["reload_err"] == 0.0 for res in results), [res[name]["reload_err"] for res in results]
            assert "transformer.wte.weight" in r0["saved_keys"] and "lm_head.weight" not in r0["saved_keys"]
        table[name] = (_rel(r0["losses"], ref_losses), werr)
    for name in FLAGSHIPS:
        r0 = results[0][name]
        args = _flagship_reference_args(flagship_yaml(name))
        scaling = args.pop("routed_scaling_factor")
        assert args["mtp"][0] == 1 and args["bias_rate"], args  # MTP and the expert bias on in every flagship
        ref_losses, ref_state, ref_norms, ref_mtp, _ = deepseek_reference(STEPS, r0["rows"], clip=1.0,
                                                                          routed_scaling_factor=scaling, **args)
        for rank, res in enumerate(results):
            r = res[name]
            assert _rel(r["losses"], ref_losses) <= 1e-5, (name, rank, r["losses"], ref_losses)
            assert _rel(r["mtp"], ref_mtp) <= 1e-5, (name, rank, r["mtp"], ref_mtp)
            assert _rel(r["norms"], ref_norms) <= 1e-5, (name, rank, r["norms"], ref_norms)
            assert r["sizes"] == {"pp": 2, "dp": 1, "tp": 2, "ep": 2, "edp": 1} and r["sp"], (name, r["sizes"])
        state = r0["state"]
        assert set(state) == set(ref_state), sorted(set(state) ^ set(ref_state))
        werr = max((state[k] - v).abs().max().item() for k, v in ref_state.items())
        assert werr <= 5e-5, (name, werr)
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert (state[bias] - deepseek_model().state_dict()[bias]).abs().max() > 0  # the balancing moved it
        assert (state[bias] - ref_state[bias]).abs().max() <= 1e-7, name
        assert sum(sum(r[name]["mtp_on_last"]) for r in results) == 2, name  # the last stage's 2 tp ranks
        table[name] = (_rel(r0["losses"], ref_losses), werr, _rel(r0["mtp"], ref_mtp))
    print({k: tuple(f"{x:.1e}" for x in v) for k, v in table.items()})
