"""DeepSeek-V4 training maths MindFormers 2.1 has and HF's DeepseekV4ForCausalLM does not:
- the lightning-indexer loss (`dsa_indexer_loss_coeff`, models/deepseek4_indexer.py): the formula against MindFormers'
  own CSAIndexer top-k + UnfusedCSAIndexerLoss run by MindSpore 2.7 (fixture, loss and the indexer's gradients), the
  hooks on HF's modules (the attention's own query and compressed kv, only the indexer trained), and dp4 x ep2 ZeRO-2,
  dp4 ZeRO-3 and pp2 x dp2 (the CSA layer on the first, non-last stage) on 4 gloo processes against one process;
- `moe_router_dtype: float32` (moe/routing.py): under bf16 the routers (V4 top-k and hash, Qwen3-MoE) choose and
  weigh like an fp32 router on inputs where bf16 routing chooses otherwise; the YAML keys read and checked."""
import json
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers.models.deepseek_v4", reason="HF DeepseekV4ForCausalLM needs transformers >= 5.24")
from deepseek4_cases import OneRank, v4_model, v4_reference
from engine_cases import global_batch, train_steps
from harness import run_distributed
from moe_cases import adamw, ep_yaml

FIXTURE = Path(__file__).parent / "fixtures" / "mindspore_dsv4" / "indexer_loss.json"
V4_YAML = Path(__file__).parent / "fixtures" / "mindformers21" / "pretrain_deepseek4_flash.yaml"
STEPS, COEFF, AUX = 2, 0.5, 0.01
MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_aux_loss_coeff=AUX,
           moe_router_load_balancing_type="seq_aux_loss", norm_topk_prob=True, routed_scaling_factor=1.5,
           dsa_indexer_loss_coeff=COEFF)
LAYOUTS = {"dp4_ep2_zero2_gas2": dict(dp=4, zero=2, ep=2, bs=1, gas=2, moe=MOE),
           # ZeRO-3 releases the indexer's position_bias after its forward (the external-parameter case)
           "dp4_zero3": dict(dp=4, zero=3, ep=1, bs=1, gas=1, moe=MOE),
           "pp2xdp2_1f1b": dict(dp=2, zero=0, ep=1, pp=2, moe=MOE)}  # layers 0-1 | 2-3: CSA (layer 1) on stage 0


def test_indexer_loss_matches_mindspore():
    import torch

    from msparallel_ds.models.deepseek4_indexer import indexer_kl

    d = json.loads(FIXTURE.read_text())
    m = d["meta"]
    q, k, w = (torch.tensor(d[n], requires_grad=True) for n in ("q", "k", "w"))
    scores = (torch.relu(torch.einsum("bsnd,bkd->bsnk", q, k[:, :, 0])) * w.unsqueeze(-1)).sum(2)  # MF's unfused
    query = torch.tensor(d["query"]).permute(1, 2, 0, 3)  # SBND -> [B, H, S, D]
    kv = torch.tensor(d["key"])[:, :, 0].permute(1, 0, 2)  # [B, T, D]
    threshold = (torch.arange(m["SQ"]) + 1).unsqueeze(0) // m["RATIO"]
    loss = m["COEFF"] * indexer_kl(scores, threshold, query, kv, m["SCALE"], m["TOPK"])
    loss.backward()
    assert abs(loss.item() - d["loss"]) <= 1e-6 * abs(d["loss"]), (loss.item(), d["loss"])
    for name, t in (("grad_q", q), ("grad_k", k), ("grad_w", w)):
        want = torch.tensor(d[name])
        assert float((t.grad - want).abs().max()) <= 1e-5 * float(want.abs().max()), name
    assert float(torch.tensor(d["grad_w"]).abs().max()) > 0


def test_hooks_use_the_attention_inputs_and_train_only_the_indexer(monkeypatch):
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    from msparallel_ds.models import adapter_for
    from msparallel_ds.models.deepseek4_indexer import indexer_kl, install_indexer_loss

    seen = {}
    eager = hf.eager_attention_forward

    def spy(module, query, key, *args, **kwargs):  # what the CSA layer's attention really attends with
        if module.layer_idx == 1:
            seen["query"], seen["key"] = query.detach(), key.detach()
        return eager(module, query, key, *args, **kwargs)

    monkeypatch.setattr(hf, "eager_attention_forward", spy)
    ids, labels = global_batch(0, 2)

    def grads(coeff):
        model = v4_model()
        aux = install_indexer_loss(model, adapter_for(model), OneRank(), coeff, None)
        scorer = model.get_submodule("model.layers.1.self_attn.compressor.indexer.scorer")
        scorer.register_forward_hook(lambda mod, a, out: seen.__setitem__("scores", out.detach()))
        model(input_ids=ids, labels=labels).loss.backward()
        return model, aux, {n: p.grad for n, p in model.named_parameters()}

    model, aux, with_loss = grads(COEFF)
    _, none, without = grads(0.0)
    assert none is None and aux is not None and aux.others == 1 and aux.routers == 0
    t = seen["scores"].shape[-1]
    want = COEFF * indexer_kl(seen["scores"], (torch.arange(ids.shape[1]) + 1).unsqueeze(0) // 4, seen["query"],
                              seen["key"][:, 0, -t:], model.model.layers[1].self_attn.scaling, 4)
    got = aux.pop_total()
    assert t == 8 and abs(float(got) - float(want)) <= 1e-6 * float(want) and float(want) > 0, (got, want)
    indexer = [n for n in with_loss if ".compressor.indexer." in n]
    assert len(indexer) == 6  # kv_proj, gate_proj, position_bias, kv_norm, q_b_proj, scorer.weights_proj
    for n in with_loss:
        if n in indexer:
            assert without[n] is None and with_loss[n] is not None, n  # only the loss reaches the indexer
            assert n.endswith("kv_norm.weight") or float(with_loss[n].abs().max()) > 0, n
        elif without[n] is not None:
            assert torch.equal(with_loss[n], without[n]), n  # its inputs are detached: the trunk is untouched
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    assert aux.pop_total() == 0  # no term outside a trained forward
    bf16 = v4_model().to(torch.bfloat16)  # the dtypes flow under bf16 (attention logits in bf16, softmaxes in fp32)
    aux = install_indexer_loss(bf16, adapter_for(bf16), OneRank(), COEFF, None)
    bf16(input_ids=ids, labels=labels).loss.backward()
    grad = bf16.get_submodule("model.layers.1.self_attn.compressor.indexer.q_b_proj").weight.grad
    assert grad.dtype == torch.bfloat16 and bool(grad.isfinite().all()) and float(grad.abs().max()) > 0
    assert abs(float(aux.pop_total()) - float(want)) <= 0.05 * float(want)

    class TwoTp(OneRank):  # tensor parallel splits the heads the target sums over: refused, naming both keys
        @staticmethod
        def size(name):
            return 2 if name == "tp" else 1

    with pytest.raises(ValueError, match="dsa_indexer_loss_coeff=.*tensor_parallel=2"):
        install_indexer_loss(v4_model(), adapter_for(model), TwoTp(), COEFF, None)


def _bf16_routers():
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    def v4(layer):  # a model per router: apply_routing converts all routers of a model
        model = v4_model(n_routed_experts=64, hidden_size=64).to(torch.bfloat16)
        return model, model.get_submodule(f"model.layers.{layer}.mlp.gate")

    qwen = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=32,
                                              moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                              num_key_value_heads=1, num_experts=64, num_experts_per_tok=4,
                                              norm_topk_prob=True)).to(torch.bfloat16)
    return [v4(1), v4(0), (qwen, qwen.get_submodule("model.layers.0.mlp.gate"))]  # top-k, hash, Qwen3-MoE


def test_bf16_routers_route_like_fp32():
    import copy
    import types

    import torch

    from msparallel_ds.models import adapter_for
    from msparallel_ds.moe.routing import apply_routing

    g = torch.Generator().manual_seed(0)
    for model, router in _bf16_routers():
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.3)
        hidden = torch.randn(2, 256, router.weight.shape[1], generator=g).to(torch.bfloat16)
        extra = (torch.randint(0, 64, (2, 256), generator=g),) if hasattr(router, "tid2eid") else ()
        reference = copy.deepcopy(router).float()  # the fp32 router on the same bf16 weights and inputs
        ref_logits, ref_weights, ref_index = reference(hidden.float(), *extra)
        plain = router(hidden, *extra)
        if not extra:  # bf16 logits choose other experts for some tokens (the test could fail)
            assert not torch.equal(plain[2], ref_index)
        else:
            assert not torch.equal(plain[1], ref_weights.to(torch.bfloat16))
        settings = types.SimpleNamespace(norm_topk_prob=None, routed_scaling_factor=None, router_dtype="float32")
        assert apply_routing(model, adapter_for(model), settings) == {"router_dtype": "float32"}
        logits, weights, index = router(hidden, *extra)
        assert torch.equal(index, ref_index) and torch.equal(logits, ref_logits), type(router).__name__
        assert weights.dtype == torch.bfloat16 and torch.equal(weights, ref_weights.to(torch.bfloat16))
        logits.sum().backward()
        assert router.weight.grad is not None and router.weight.grad.dtype == torch.bfloat16
        assert isinstance(copy.deepcopy(router), type(router))


def test_yaml_keys_reach_the_model():
    import types

    import yaml
    from transformers import LlamaConfig, LlamaForCausalLM

    import msparallel_ds as msp
    from msparallel_ds.config.errors import ConfigError
    from msparallel_ds.strategy import Options, parallelize_part

    doc = yaml.safe_load(V4_YAML.read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = msp.load_config(doc)
        assert cfg.moe.router_dtype == "float32" and cfg.model.dsa_indexer_loss_coeff == 1.0
        plan = msp.make_plan(doc, world_size=8)
        assert Options.from_plan(plan).indexer_loss_coeff == 1.0
        mcore = ep_yaml(dp=4, moe={**MOE, "moe_router_dtype": "bf16"})
        assert msp.load_config(mcore).moe.router_dtype == "bfloat16"
        legacy = msp.load_config({**ep_yaml(dp=4), "moe_config": {"expert_num": 4, "router_dense_type": "float16"}})
        assert legacy.moe.router_dtype == "float16"
        for key, value in (("moe_router_dtype", "int8"), ("dsa_indexer_loss_coeff", -1.0)):
            with pytest.raises(ConfigError) as ei:
                msp.load_config(ep_yaml(dp=4, moe={**MOE, key: value}))
            assert key in str(ei.value), str(ei.value)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.warns(UserWarning, match="dsa_indexer_loss_coeff=1 is not applied to LlamaForCausalLM"):
        parallelize_part(llama, types.SimpleNamespace(size=lambda name: 1), Options(indexer_loss_coeff=1.0))


def _train(name):
    import msparallel_ds as msp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = msp.initialize(v4_model(), msp.load_config(ep_yaml(**LAYOUTS[name])), optimizer=adamw)
    return {**train_steps(engine, STEPS, aux=lambda e: e.last_aux_loss),
            "state": engine.full_state_dict(rank0_only=True)}


def _run(rank, world_size):
    import torch

    torch.set_num_threads(1)
    return {name: _train(name) for name in LAYOUTS}


@pytest.mark.distributed
def test_indexer_loss_parallel_matches_single_process():
    results = run_distributed(_run, 4, timeout=300)
    for name in LAYOUTS:
        r0 = results[0][name]
        micro = r0["micro"] * (4 if "pp" not in name else 2)
        ref_losses, ref_state, ref_aux = v4_reference(STEPS, r0["rows"], clip=0.05, aux=AUX, micro=micro,
                                                      indexer=COEFF)
        _, _, plain_aux = v4_reference(1, r0["rows"], clip=0.05, aux=AUX, micro=micro)
        assert ref_aux[0] > plain_aux[0] * 1.5, (ref_aux, plain_aux)  # the indexer term is in the aux values
        print(name, "loss error", max(abs(g - w) / abs(w) for res in results for g, w in
                                      zip(res[name]["losses"], ref_losses)),
              "aux (incl. indexer) error", max(abs(g - w) / abs(w) for res in results for g, w in
                                               zip(res[name]["aux"], ref_aux)), "aux", ref_aux, "without", plain_aux)
        for res in results:
            for got, want in zip(res[name]["losses"] + res[name]["aux"], ref_losses + ref_aux):
                assert abs(got - want) <= 1e-5 * abs(want), (name, res[name]["losses"], ref_losses, res[name]["aux"],
                                                             ref_aux)
        start, worst = v4_model().state_dict(), 0.0
        for k, want in ref_state.items():
            if want.is_floating_point():
                err = float((r0["state"][k] - want).abs().max()) / max(float(want.abs().max()), 1.0)
                worst = max(worst, err)
                assert err <= 1e-5, (name, k, err)
                if ".compressor.indexer.q_b_proj" in k:  # trained, and trained alike
                    assert float((want - start[k]).abs().max()) > 1e-4, k
        print(name, "worst weight error", worst)
