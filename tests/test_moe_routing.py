"""MoE routing and balance loss as MindFormers 2.1 computes them (mcore, parallel_core/training_graph/transformer/moe/
router.py), through msp.initialize on 4 gloo processes against a single-process reference written by hand from
MindFormers' formulas (not from moe.aux_loss):

- gbs_aux_loss (router.py:408-419): f is the micro-batch's global expert fraction ADDED to fi_accu, and the micro-batch
  uses fi_accu / sum(fi_accu) (the running mean of the step's micro-batches so far); fi_accu is reset at step end
  (core/callback/callback.py:531-539, gpt_model.py:675-679). Under gradient accumulation (DeepSpeed engine) and under
  a 1F1B pipeline (pipeline engine).
- seq_aux_loss (router.py:405): f averaged over the tp shards only (shards (dp*cp*tp) reshaped to (dp*cp, tp)), so
  each cp chunk of a row has its own f; here cp2 (Ulysses, contiguous chunks) x tp2 + SP.
- mcore MoE with model_parallel 2 and sequence parallel off (refused for the legacy moe_config only,
  tools/check_rules.py:169-176): each tp rank routes its own sequence slice, as MindFormers' dp*cp*tp router shards.
- routed_scaling_factor (router.py:295) and norm_topk_prob (router.py:290-293): the YAML's values, not the HF
  config's (Qwen3-MoE: norm_topk_prob false, no scaling factor), with a warning.

Losses and aux values per step within 1e-4 relative, final weights within 5e-5; a control shows the accumulated f
changes the result (per-micro-batch f gives another aux loss).
"""
import pytest
from engine_cases import BETAS, EPS, LR, global_batch
from harness import run_distributed
from moe_cases import adamw, ep_yaml, moe_model

pytestmark = pytest.mark.distributed

STEPS, CLIP = 2, 0.05
CASES = {  # name -> (tiny_config kwargs, mcore MoE keys, micro-batches per step, shards per micro-batch row)
    # + full recompute: the recomputed forward (in backward) must not add to the accumulated f nor change it
    "gbs_dp2xtp2_sp_gas2_ep2_scaled_recompute": (dict(dp=2, tp=2, sp=True, zero=1, ep=2, gas=2, recompute=True), dict(
        moe_aux_loss_coeff=0.02, moe_router_load_balancing_type="gbs_aux_loss", routed_scaling_factor=1.5,
        norm_topk_prob=True), 2),
    "gbs_pp2xdp2_mbn4_ep2": (dict(dp=2, zero=0, ep=2, pp=2), dict(
        moe_aux_loss_coeff=0.02, moe_router_load_balancing_type="gbs_aux_loss"), 4),
    "seq_cp2_ulysses_xtp2_sp_ep2": (dict(cp=2, algo="ulysses_cp", tp=2, sp=True, zero=1, ep=2), dict(
        moe_aux_loss_coeff=0.02, moe_router_load_balancing_type="seq_aux_loss"), 1),
    # mcore MoE with tp > 1 and SP off runs (only legacy moe_config is refused: tools/check_rules.py:169-176)
    "seq_dp2xtp2_no_sp_ep2": (dict(dp=2, tp=2, sp=False, zero=1, ep=2), dict(
        moe_aux_loss_coeff=0.02, moe_router_load_balancing_type="seq_aux_loss"), 1),
}


def _yaml(kw, moe):
    y = ep_yaml(moe=moe, clip=CLIP, **kw)
    y["model"]["model_config"]["num_layers"] = 2
    return y


def _train(name):
    import warnings

    import msparallel_ds as msp

    kw, moe, _ = CASES[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = msp.initialize(moe_model(), msp.load_config(_yaml(kw, moe)), optimizer=adamw)
    lay = engine.layout
    micro = engine.micro_batch_size * engine.gradient_accumulation_steps if lay.size("pp") == 1 else \
        engine.plan.micro_batch_size * engine.plan.micro_batch_num
    losses, aux = [], []
    for step in range(STEPS):
        ids, labels = global_batch(step, micro * lay.size("dp"))
        share = slice(lay.rank("dp") * micro, (lay.rank("dp") + 1) * micro)
        losses.append(engine.train_batch({"input_ids": ids[share], "labels": labels[share]}).item())
        aux.append(engine.last_aux_loss)
    return {"losses": losses, "aux": aux, "state": engine.full_state_dict(rank0_only=True),
            "rows": micro * lay.size("dp"), "dp": lay.size("dp"), "cp": lay.size("cp"),
            "warnings": [str(w.message) for w in caught]}


def _run(rank, world_size, names):
    import torch

    torch.set_num_threads(1)
    return {name: _train(name) for name in names}


def reference(moe, steps, rows, dp, cp, micro_batches, accumulate=True):
    """One process, the whole global batch: micro-batch m holds row d*M + m of every dp rank d (M micro-batches per
    dp rank); routing weights and balance loss written from MindFormers' router.py. Returns (losses, aux, state)."""
    import torch

    model = moe_model("qwen3_moe")
    scale, norm = moe.get("routed_scaling_factor", 1.0), moe.get("norm_topk_prob", False)
    coeff, kind = moe["moe_aux_loss_coeff"], moe["moe_router_load_balancing_type"]
    terms, accu = [], {}

    def router(module, args, out):
        logits, _, index = out
        e, k = logits.shape[-1], index.shape[-1]
        probs = torch.softmax(logits.float(), -1)
        gate = probs.gather(1, index)
        if norm and k > 1:  # router.py:290-293
            gate = gate / (gate.sum(-1, keepdim=True) + 1e-20)
        gate = gate * scale  # router.py:295
        onehot = torch.nn.functional.one_hot(index, e).float()  # [T, k, E]
        if kind == "gbs_aux_loss":  # router.py:408-419: one f for the micro-batch, accumulated over the step
            f = onehot.mean((0, 1))
            if accumulate:
                accu[id(module)] = accu.get(id(module), 0) + f
                f = accu[id(module)] / accu[id(module)].sum()
            term = (probs.mean(0) * f).sum()
        else:  # seq_aux_loss, router.py:405: each row's cp chunk (its tp shards together) has its own f
            chunks = rows_in_micro * cp
            p_c = probs.view(chunks, -1, e).mean(1)
            f_c = onehot.view(chunks, -1, k, e).mean((1, 2))
            term = (p_c * f_c).sum(-1).mean()
        terms.append(coeff * e * term)
        return logits, gate.to(logits.dtype), index

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(router)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    per_dp = rows // dp
    rows_in_micro = dp * per_dp // micro_batches
    losses, aux_values = [], []
    for step in range(steps):
        ids, labels = global_batch(step, rows)
        accu.clear()  # reset at step end
        opt.zero_grad()
        lm_total, aux_total = 0.0, 0.0
        for m in range(micro_batches):
            pick = [d * per_dp + j for d in range(dp) for j in range(per_dp) if j % micro_batches == m]
            terms.clear()
            lm = model(input_ids=ids[pick], labels=labels[pick]).loss
            aux = sum(terms)
            ((lm + aux) / micro_batches).backward()
            lm_total += lm.item() / micro_batches
            aux_total += float(aux) / micro_batches
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(lm_total)
        aux_values.append(aux_total)
    return losses, aux_values, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_mindformers_routing_matches_reference():
    results = run_distributed(_run, 4, list(CASES), timeout=600)
    for name, (kw, moe, micro_batches) in CASES.items():
        r0 = results[0][name]
        ref_losses, ref_aux, ref_state = reference(moe, STEPS, r0["rows"], r0["dp"], r0["cp"], micro_batches)
        for rank, res in enumerate(results):
            r = res[name]
            rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses))
            assert rel <= 1e-4, (name, rank, r["losses"], ref_losses)
            arel = max(abs(a - b) / abs(b) for a, b in zip(r["aux"], ref_aux))
            assert arel <= 1e-4, (name, rank, r["aux"], ref_aux)
        werr = max((r0["state"][k] - v).abs().max().item() for k, v in ref_state.items())
        assert werr <= 5e-5, (name, werr)
        if micro_batches > 1:  # the control: each micro-batch's own f gives another aux loss
            plain = reference(moe, 1, r0["rows"], r0["dp"], r0["cp"], micro_batches, accumulate=False)[1]
            assert abs(plain[0] - ref_aux[0]) > 1e-6 * abs(ref_aux[0]), (name, plain, ref_aux)
        if "routed_scaling_factor" in moe:
            said = " ".join(r0["warnings"])
            assert "routed_scaling_factor=1.5 differs from the HF model's (a Qwen3MoeConfig has none: 1)" in said
            assert "norm_topk_prob=True differs from the HF model's Qwen3MoeConfig.norm_topk_prob=False" in said
