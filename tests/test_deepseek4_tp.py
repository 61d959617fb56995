"""Tensor parallel for DeepSeek-V4 (models/deepseek4_tp.py: heads, sinks and the grouped output projection split;
the shared kv head, compressors and lightning indexer replicated; MoE on each tp rank's sequence slice with the hash
routers' input ids cut alike; hyper-connections replicated) through msp.initialize on 4 gloo processes equals one
process on the whole global batch (tests/deepseek4_cases.py: sliding, compressed sparse + indexer, heavily
compressed, sliding layers): per-step losses over 3 AdamW steps (relative <= 1e-6), aux losses (<= 1e-5), the global
gradient norm the engine measured at every step (<= 1e-5: tp shards and replicas each counted once) and the final
weights gathered over tp and ep (max |d| relative to max(max |w|, 1) <= 1e-5). Layouts: tp2 x dp2 x ep2 with ZeRO-2,
a vocab-parallel embedding and head, 2 sequences per micro-batch, the seq aux loss and the expert bias; tp2 x pp2 x
ep2 with sequence parallel, full recompute and 1F1B over 4 micro-batches (3 hash layers, so stage 1 hash-routes layer
2 on its sequence slice of the ids it is passed)."""
import pytest

pytest.importorskip("transformers.models.deepseek_v4", reason="HF DeepseekV4ForCausalLM needs transformers >= 5.24")
from deepseek4_cases import state_error, v4_model, v4_reference
from engine_cases import train_steps
from harness import run_distributed
from moe_cases import adamw as _adamw
from moe_cases import ep_yaml

STEPS, CLIP, RATE, AUX = 3, 0.05, 0.01, 0.01
MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_aux_loss_coeff=AUX,
           moe_router_load_balancing_type="seq_aux_loss", moe_router_enable_expert_bias=True,
           moe_router_bias_update_rate=RATE, norm_topk_prob=True, routed_scaling_factor=1.5)
LAYOUTS = {  # name -> (ep_yaml kwargs, v4_config overrides)
    "tp2xdp2_ep2_zero2_vocab": (dict(dp=2, tp=2, ep=2, zero=2, bs=2, vocab_dp=False, moe=MOE), {}),
    # 1F1B over 4 micro-batches, 3 hash layers: stage 1 hash-routes layer 2 on its sequence slice
    "tp2xpp2_ep2_sp_1f1b_recompute": (dict(dp=1, tp=2, ep=2, zero=0, pp=2, sp=True, recompute=True, moe=MOE),
                                      dict(num_hash_layers=3)),
}


def _train(name):
    import msparallel_ds as msp

    kw, model_kw = LAYOUTS[name]
    engine = msp.initialize(v4_model(**model_kw), msp.load_config(ep_yaml(clip=CLIP, **kw)), optimizer=_adamw)
    out = train_steps(engine, STEPS, aux=lambda e: e.last_aux_loss, norms=lambda e: float(e.global_grad_norm))
    sinks = next(p for n, p in engine.model.named_parameters() if n.endswith("self_attn.sinks"))
    return {**out, "state": engine.full_state_dict(rank0_only=True),
            "sizes": {n: engine.layout.size(n) for n in ("tp", "dp", "ep", "pp")}, "local_sinks": sinks.numel()}


def _run(rank, world_size, names):
    import torch

    torch.set_num_threads(1)
    return {name: _train(name) for name in names}


def _rel(got, want):
    return abs(got - want) / max(abs(want), 1e-30)


def _reference(rows, micro, **model_kw):
    """v4_reference, with the global gradient norm clip_grad_norm_ measured (before clipping) at each step."""
    import torch

    clip, norms = torch.nn.utils.clip_grad_norm_, []

    def measured(*args, **kwargs):
        norms.append(float(clip(*args, **kwargs)))
        return norms[-1]

    torch.nn.utils.clip_grad_norm_ = measured
    try:
        out = v4_reference(STEPS, rows, clip=CLIP, bias_rate=RATE, aux=AUX, micro=micro, **model_kw)
    finally:
        torch.nn.utils.clip_grad_norm_ = clip
    return (*out, norms)


@pytest.mark.distributed
def test_deepseek_v4_tensor_parallel_matches_single_process():
    results = run_distributed(_run, 4, list(LAYOUTS), timeout=300)
    for name, (kw, model_kw) in LAYOUTS.items():
        r0 = results[0][name]
        assert r0["sizes"] == {"tp": 2, "dp": kw["dp"], "ep": 2, "pp": kw.get("pp", 1)}, r0["sizes"]
        assert r0["local_sinks"] == 2  # 4 heads over tp 2
        ref_losses, ref_state, ref_aux, ref_norms = _reference(r0["rows"], r0["micro"] * kw["dp"], **model_kw)
        for rank, res in enumerate(results):
            r = res[name]
            for got, want in zip(r["losses"], ref_losses):
                assert _rel(got, want) <= 1e-6, (name, rank, r["losses"], ref_losses)
            for got, want in zip(r["aux"], ref_aux):
                assert _rel(got, want) <= 1e-5, (name, rank, r["aux"], ref_aux)
        worst = state_error(r0["state"], ref_state, 1e-5, name)
        for got, want in zip(r0["norms"], ref_norms):
            assert _rel(got, want) <= 1e-5, (name, r0["norms"], ref_norms)
        print(name, "loss error", max(_rel(g, w) for res in results for g, w in zip(res[name]["losses"], ref_losses)),
              "aux error", max(_rel(g, w) for res in results for g, w in zip(res[name]["aux"], ref_aux)),
              "worst weight error", worst, "grad norm error",
              max(_rel(g, w) for g, w in zip(r0["norms"], ref_norms)))


def test_tensor_parallel_spec_and_refusals():
    """The shard spec the checkpoints read (a pure function of the plan): per-head parameters split along dim 0, the
    shared kv head, compressors and indexer replicated; tp must divide num_attention_heads and o_groups (both are
    split): one clear error naming the key."""
    from msparallel_ds.models import adapter_for
    from msparallel_ds.tensor_parallel.spec import ShardSpec

    model = v4_model()
    adapter = adapter_for(model)
    plan = adapter.tp_plan(model.config, 2, sequence_parallel=True, vocab_parallel=True)
    assert plan["model.layers.0.mlp"] == "sequence_parallel_block"
    spec = ShardSpec.from_plan(plan, [n for n, _ in model.named_parameters()])
    attn = "model.layers.1.self_attn."
    split = {n: spec[n].dim for n in spec.split_names("tp")}
    for name in ("sinks", "q_b_proj.weight", "o_a_proj.weight"):
        assert split.pop(attn + name) == 0, name
    assert split.pop(attn + "o_b_proj.weight") == 1
    assert split.pop("model.embed_tokens.weight") == 0 and split.pop("lm_head.weight") == 0
    assert all(".self_attn.sinks" in n or ".self_attn.q_b_proj." in n or ".self_attn.o_" in n for n in split), split
    assert not any(spec[attn + n].is_split for n in ("q_a_proj.weight", "kv_proj.weight", "compressor.kv_proj.weight",
                                                       "compressor.position_bias", "compressor.indexer.q_b_proj.weight",
                                                       "compressor.indexer.scorer.weights_proj.weight"))
    for tp, key in ((8, "model.num_attention_heads=4"), (4, "model.o_groups=2")):
        with pytest.raises(ValueError) as ei:
            adapter.tp_plan(model.config, tp)
        assert key in str(ei.value) and "parallelism.tensor_parallel" in str(ei.value), str(ei.value)
