"""The GLM (glm, glm4) and GPT-2 families through msp.initialize on 4 gloo processes equal one process: per-step
losses over 3 AdamW steps (relative error <= 1e-6) and the final weights (<= 1e-5), for dp2 x tp2 + SP + vocab
parallel, tp2 x cp2 ring and pp2 x dp2 (interleaved, 2 virtual stages). glm4_moe: dp2 x ep2 x tp2 + SP. One spawned
run covers every case (process start-up dominates on CPU); the references run in the pytest process.
"""
import pytest
from engine_cases import global_batch, tiny_config
from family_cases import BETAS, EPS, LR, reference_run, tiny_family
from harness import run_distributed

pytestmark = pytest.mark.distributed

STEPS = 3
CASES = {  # name -> tiny_config kwargs (+ pp, vpp, ep)
    "dp2xtp2_sp_vocab": dict(dp=2, tp=2, sp=True, vocab_dp=False),
    "tp2xcp2_ring": dict(tp=2, cp=2, ring=True, sp=True),
    "pp2_vpp2_dp2": dict(dp=2, pp=2, vpp=2),
}
MOE_CASES = {"dp2xep2xtp2_sp": dict(dp=2, tp=2, sp=True, ep=2)}  # glm4_moe: ep folds tp (MindFormers / mcore)
# GLM layers have no LayerParts: under 2 copies x fine_grain 2 they run whole, interleaved as copies
GLM_CASES = {"dp2xtp2_sp_2copies_fine_grain2": dict(dp=2, tp=2, sp=True, bs=2, mbi=2, fine_grain=2)}


def _cases(family):
    if family == "glm4_moe":
        return MOE_CASES
    return {**CASES, **GLM_CASES} if family in ("glm", "glm4") else CASES


def _config(case):
    kw = dict({**CASES, **MOE_CASES, **GLM_CASES}[case])
    pp, vpp, ep = kw.pop("pp", 1), kw.pop("vpp", 1), kw.pop("ep", 1)
    mbi, fine_grain = kw.pop("mbi", 1), kw.pop("fine_grain", 1)
    c = tiny_config(**kw)
    c["micro_batch_interleave_num"] = mbi
    c["model"]["model_config"]["fine_grain_interleave"] = fine_grain
    c["parallel_config"]["expert_parallel"] = ep
    if pp > 1:
        c["parallel_config"].update(pipeline_stage=pp, micro_batch_num=4)
        c["parallel"]["pipeline_config"] = {"pipeline_interleave": vpp > 1, "pipeline_scheduler": "1f1b"}
        c["model"]["model_config"]["pp_interleave_num"] = vpp
    return c


def _adamw(params):
    import torch

    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)


def _tied(family, case):
    """GPT-2 ties its head to wte, also across pipeline stages (pipeline.shared)."""
    return family == "gpt2"


def _round_trip(engine, save_dir):
    """save_pretrained of the tp run, then plain HF and msp.from_pretrained (tp shards read per fused block):
    max |logits diff| against the parallel model's, (plain, reloaded)."""
    import torch
    from transformers import AutoModelForCausalLM

    import msparallel_ds as msp
    from msparallel_ds.distributed.collectives import all_gather_along

    engine.save_pretrained(save_dir)
    ids, _ = global_batch(99, 2)
    lay = engine.layout

    def logits(model):
        with torch.no_grad():
            out = model.eval()(input_ids=ids).logits
        return all_gather_along(out, lay.group("tp"), -1) if getattr(model.lm_head, "tp", 1) > 1 else out

    ours = logits(engine.model)
    reloaded = logits(msp.from_pretrained(save_dir, lay))
    plain = logits(AutoModelForCausalLM.from_pretrained(save_dir)) if lay.global_rank == 0 else ours
    return (plain - ours).abs().max().item(), (reloaded - ours).abs().max().item()


def _train(rank, world_size, family, cases, save_dir):
    import msparallel_ds as msp

    out = {}
    for case in cases:
        model = tiny_family(family, _tied(family, case))
        engine = msp.initialize(model, msp.load_config(_config(case)), optimizer=_adamw)
        lay = engine.layout
        rows = engine.micro_batch_size * engine.gradient_accumulation_steps
        losses = []
        for step in range(STEPS):
            ids, labels = global_batch(step, rows * lay.size("dp"))
            share = slice(lay.rank("dp") * rows, (lay.rank("dp") + 1) * rows)
            losses.append(engine.train_batch({"input_ids": ids[share], "labels": labels[share]}).item())
        state = engine.full_state_dict(rank0_only=True)
        out[case] = {"losses": losses, "rows": rows * lay.size("dp"), "state": state if rank == 0 else None,
                     "sizes": {n: lay.size(n) for n in ("pp", "dp", "tp", "cp", "ep")},
                     "tp_plan": dict(engine.applied.tp_plan) if hasattr(engine, "applied") else {},
                     "interleaved": getattr(getattr(engine, "applied", None), "interleave", None) is not None,
                     "round_trip": _round_trip(engine, f"{save_dir}/{case}") if case == "dp2xtp2_sp_vocab" else None}
    return out


def _check(family, results):
    refs, table = {}, {}
    cases = _cases(family)
    for case in cases:
        key = results[0][case]["rows"], _tied(family, case)
        if key not in refs:
            refs[key] = reference_run(family, STEPS, key[0], tied=key[1])
        ref_losses, ref_state = refs[key]
        worst = 0.0
        for rank, r in enumerate(results):
            rel = max(abs(a - b) / abs(b) for a, b in zip(r[case]["losses"], ref_losses))
            if r[case]["sizes"]["pp"] == 1 or rank == 0:  # pipeline: the loss is reported where it is known
                assert rel <= 1e-6, (family, case, rank, r[case]["losses"], ref_losses)
                worst = max(worst, rel)
        want = {n: cases[case].get(n, 1) for n in ("pp", "dp", "tp", "cp", "ep")}
        if cases[case].get("mbi", 1) > 1:
            assert results[0][case]["interleaved"], (family, case)
        assert results[0][case]["sizes"] == want, (case, results[0][case]["sizes"])
        if want["tp"] > 1:  # the family's own plan ran (not a replicated fallback)
            assert len(results[0][case]["tp_plan"]) >= 4, results[0][case]["tp_plan"]
        state = results[0][case]["state"]
        assert set(state) >= {k for k in ref_state if not k.endswith("rotary_emb.inv_freq")}, (family, case)
        diffs = sorted(((state[k] - v).abs().max().item(), k) for k, v in ref_state.items() if k in state)
        # the interleaved copies sum each embedding row's few-token gradient in another order, which Adam turns
        # into up to ~2e-5 on rare rows after 3 steps: the other suites' 5e-5 there (losses stay at 1e-6)
        assert diffs[-1][0] <= (5e-5 if case in GLM_CASES else 1e-5), (family, case, diffs[-4:])
        table[case] = (worst, diffs[-1][0])
        for r in results:
            if r[case]["round_trip"] is not None:
                assert max(r[case]["round_trip"]) <= 1e-5, (family, case, r[case]["round_trip"])
    return table


FAMILIES = ("glm", "glm4", "gpt2", "glm4_moe")


def _train_all(rank, world_size, save_dir):
    import torch

    torch.set_num_threads(1)
    return {family: _train(rank, world_size, family, list(_cases(family)), f"{save_dir}/{family}")
            for family in FAMILIES}


def test_families_match_single_process(tmp_path):
    """One spawned run for every family's cases (start-up and imports once); checked family by family."""
    results = run_distributed(_train_all, 4, str(tmp_path), timeout=600)
    table = {family: _check(family, [r[family] for r in results]) for family in FAMILIES}
    for family, rows in table.items():  # the parity table (pytest -s shows it)
        for case, (loss_rel, weights) in rows.items():
            print(f"{family:9s} {case:18s} loss rel {loss_rel:.1e}  weights {weights:.1e}")
    assert set(table) == set(FAMILIES)


def test_fused_block_shard_layout(monkeypatch):
    """Shard(parts=k): rank r holds every block's chunk r, in block order; indices() name the same rows of the full
    tensor (what from_pretrained reads), and the ranks' parts, rank-major as an all-gather returns them,
    rearrange to the full tensor (what save gathers)."""
    import torch

    from msparallel_ds.distributed import collectives
    from msparallel_ds.tensor_parallel.spec import STYLE_PARAM_SHARDS, Shard

    full = torch.arange(24 * 3).reshape(24, 3)
    for parts, dim in ((2, 0), (3, 0), (3, 1)):
        t = full if dim == 0 else full.t().contiguous()
        shard, tp = Shard(dim, "split", parts=parts), 2
        local = [shard.local(t, tp, r) for r in range(tp)]
        for r in range(tp):
            blocks = t.chunk(parts, dim)
            assert torch.equal(local[r], torch.cat([b.chunk(tp, dim)[r] for b in blocks], dim))
            assert torch.equal(torch.cat([t[i] for i in shard.indices(local[r].shape, tp, r)], dim), local[r])
        monkeypatch.setattr(collectives, "all_gather_along", lambda x, group, d: torch.cat(local, d))  # rank-major
        assert torch.equal(shard.gather(local[0], None), t)
    assert STYLE_PARAM_SHARDS["colwise_halves"]["weight"].parts == 2
    assert STYLE_PARAM_SHARDS["conv1d_colwise_qkv"]["weight"] == Shard(1, "split", parts=3)
