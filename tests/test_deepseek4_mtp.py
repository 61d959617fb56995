"""DeepSeek-V4 multi-token prediction (models/deepseek4_mtp.py: MindFormers 2.1's pynative V4 MTP block, one V4 decoder
block with its hyper-connection streams, a top-k router, its own hc_head) through msp.initialize on 4 gloo processes
equals one process on the whole global batch over 3 steps: the LM loss (relative <= 1e-6), the MTP loss
(engine.last_mtp_loss, relative <= 1e-6), the aux loss and the final weights, MTP layer and experts gathered
(max |difference| relative to max(|w|, 1) <= 1e-5). Layouts: dp4 x ep2 (edp 2) ZeRO-2 with full recompute (the MTP
layer too), and pp2 x dp2 x ep2 1F1B (the MTP layer on the last stage, added there by the engine; the word embedding
shared by the first and last stage). The reference writes the MTP depth out plainly (below) on the HF modules. The
four wheel deepseek4 YAMLs, unscaled (num_nextn_predict_layers: 1, mtp_loss_factor: 0.3), are no longer refused:
they plan at their own world and the family accepts their options."""
from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers.models.deepseek_v4", reason="HF DeepseekV4ForCausalLM needs transformers >= 5.24")
from deepseek4_cases import EXPERTS, TOP_K, state_error, v4_model
from deepseek_cases import update_expert_bias
from engine_cases import BETAS, EPS, LR, VOCAB, global_batch, train_steps
from harness import run_distributed
from moe_cases import adamw as _adamw
from moe_cases import ep_yaml

STEPS, CLIP, RATE, AUX, SCALE = 3, 0.05, 0.01, 0.01, 0.3
MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_aux_loss_coeff=AUX,
           moe_router_load_balancing_type="seq_aux_loss", moe_router_enable_expert_bias=True,
           moe_router_bias_update_rate=RATE, norm_topk_prob=True, routed_scaling_factor=1.5)
LAYOUTS = {"dp4_ep2_zero2_recompute_mtp": dict(dp=4, zero=2, ep=2, recompute=True, moe=MOE),
           "pp2xdp2_ep2_1f1b_mtp": dict(dp=2, zero=0, ep=2, pp=2, moe=MOE)}
ROUTER = "model.layers.4.mlp.gate.weight"  # the MTP layer's (layer N = 4)
FIXTURES = Path(__file__).parent / "fixtures" / "mindformers21"
V4 = ["pretrain_deepseek4_flash.yaml", "pretrain_deepseek4_flash_reduction.yaml", "pretrain_deepseek4_pro.yaml",
      "pretrain_deepseek4_pro_reduction.yaml"]


def mtp_yaml(**kw):
    y = ep_yaml(clip=CLIP, **kw)
    y["use_legacy"] = False  # MindFormers 2.1 (pynative) spellings, as the deepseek4 YAMLs
    y["model"]["model_config"].update(num_nextn_predict_layers=1, mtp_loss_factor=SCALE)
    return y


def mtp_model(with_layer=False):
    """The tiny V4 (deepseek4_cases); `with_layer`: with its MTP layer as models.mtp adds it (seeded), the router
    given larger weights like the decoder's (so its choices vary)."""
    import torch

    from msparallel_ds.models.deepseek4_mtp import make_mtp_layer
    from msparallel_ds.models.mtp import add_mtp_layers

    model = v4_model()
    if with_layer:
        add_mtp_layers(model, 1, make_mtp_layer)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        for name, p in model.named_parameters():
            if name == ROUTER:
                p.normal_(0.0, 0.5)
    return model


def _train(name):
    import msparallel_ds as msp

    import torch

    pp = LAYOUTS[name].get("pp", 1) > 1  # pp: the engine adds the MTP layer (seeded); its router gets the test's
    engine = msp.initialize(mtp_model(with_layer=not pp), msp.load_config(mtp_yaml(**LAYOUTS[name])), optimizer=_adamw)
    if pp:  # plain AdamW (ZeRO off), no state yet: setting the weight in place is the start
        start = mtp_model(with_layer=True).state_dict()
        with torch.no_grad():
            for k, p in engine.model.named_parameters():
                if k == ROUTER:
                    p.copy_(start[k])
    layer = dict(engine.model.named_modules()).get("model.layers.4")
    out = train_steps(engine, STEPS, mtp=lambda e: e.last_mtp_loss, aux=lambda e: e.last_aux_loss)
    return {**out, "state": engine.full_state_dict(rank0_only=True),
            "mtp_layer": type(layer).__name__ if layer else None}


def _run(rank, world_size, names):
    import torch

    torch.set_num_threads(1)
    return {name: _train(name) for name in names}


def plain_mtp_logits(model, ids, h):
    """Depth 1 written out (MindFormers 2.1 multi_token_prediction.py:397-433): h = the decoder's normed output,
    eh_proj([enorm(embed(ids << 1)), hnorm(h)]) copied into the hc streams, the V4 block, hc_head, final norm, head."""
    import torch
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

    base, n = model.model, model.config.num_hidden_layers
    layer = base.layers[n]
    e = base.embed_tokens(torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1))
    x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(h)], -1))
    x = x[:, :, None, :].repeat(1, 1, model.config.hc_mult, 1)
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    rope = {k: base.rotary_emb(e, position_ids=pos, layer_type=k) for k in ("main", "compress")}
    mask = create_sliding_window_causal_mask(config=model.config, inputs_embeds=e, attention_mask=None, cache=None,
                                             position_ids=pos)
    x = DeepseekV4DecoderLayer.forward(layer, x, position_embeddings=rope, position_ids=pos, attention_mask=mask)
    return model.lm_head(layer.shared_head.norm(layer.hc_head(x)))


def reference(rows, micro):
    """One process, the whole global batch in `micro`-row forwards: LM loss + SCALE x the depth-1 token mean
    (targets: labels shifted by 2), MindFormers 2.1's per-sequence seq aux loss on every router (the MTP layer's
    too), global-norm clipping, AdamW, the expert-bias update of the top-k routers (the MTP router's too)."""
    import torch
    import torch.nn.functional as F

    model = mtp_model(with_layer=True)
    terms, counts = [], {}

    def hook(router, args, out, name):
        logits, _, index = out
        b = args[0].shape[0]
        s = torch.sqrt(F.softplus(logits.float()))
        s = (s / (s.sum(-1, keepdim=True) + 1e-20)).view(b, -1, EXPERTS)
        top = torch.topk(s, TOP_K, dim=-1).indices
        f = torch.stack([torch.bincount(t.reshape(-1), minlength=EXPERTS).float() / t.numel() for t in top])
        terms.append(AUX * EXPERTS * (s.mean(1) * f).sum(-1).mean())
        if not hasattr(router, "tid2eid"):
            counts[name] = counts.get(name, 0) + torch.bincount(index.reshape(-1), minlength=EXPERTS)

    for name, router in model.named_modules():
        if name.endswith("mlp.gate"):
            router.register_forward_hook(lambda m, a, o, name=name: hook(m, a, o, name))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    out = {"losses": [], "mtp": [], "aux": []}
    for step in range(STEPS):
        ids, labels = global_batch(step, rows)
        opt.zero_grad()
        lm_total = mtp_total = aux_total = 0.0
        for lo in range(0, rows, micro):
            i, t = ids[lo:lo + micro], labels[lo:lo + micro]
            h = model.model(input_ids=i).last_hidden_state  # the MTP layer passes the decoder's loop through
            lm = F.cross_entropy(model.lm_head(h)[:, :-1].reshape(-1, VOCAB), t[:, 1:].reshape(-1))
            mtp = F.cross_entropy(plain_mtp_logits(model, i, h)[:, :-2].reshape(-1, VOCAB), t[:, 2:].reshape(-1))
            aux = sum(terms)
            terms.clear()
            ((lm + SCALE * mtp + aux) * (micro / rows)).backward()
            lm_total += lm.item() * micro / rows
            mtp_total += mtp.item() * micro / rows
            aux_total += float(aux.detach()) * micro / rows
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        update_expert_bias(model, counts, RATE)
        for k, v in (("losses", lm_total), ("mtp", mtp_total), ("aux", aux_total)):
            out[k].append(v)
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _rel(got, want):
    return abs(got - want) / max(abs(want), 1e-30)


@pytest.mark.distributed
def test_deepseek_v4_mtp_matches_single_process():
    import torch

    results = run_distributed(_run, 4, list(LAYOUTS), timeout=300)
    start = mtp_model(with_layer=True)
    plain = v4_model()  # the MTP layer leaves the decoder's output alone (HF's loop calls it: it passes through)
    ids = global_batch(0, 2)[0]
    assert torch.equal(start(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert type(start.model.layers[4].mlp.gate).__name__ == "DeepseekV4TopKRouter"  # MTP: never hash-routed
    assert start.model.layers[4].self_attn.layer_type == "sliding_attention"
    for name, layout in LAYOUTS.items():
        r0 = results[0][name]
        holders = [res[name]["mtp_layer"] for res in results]  # pp: only the last stage's 2 ranks hold it
        n_holders = 2 if "pp" in layout else 4
        assert sorted(holders, key=str) == ["DeepseekV4MTPLayer"] * n_holders + [None] * (4 - n_holders), holders
        ref = reference(r0["rows"], r0["micro"] * (4 // layout.get("pp", 1)))  # rows per forward: micro x dp
        for rank, res in enumerate(results):
            r = res[name]
            for key, bound in (("losses", 1e-6), ("mtp", 1e-6), ("aux", 1e-5)):
                for got, want in zip(r[key], ref[key]):
                    assert _rel(got, want) <= bound, (name, rank, key, r[key], ref[key])
        state = r0["state"]
        assert any(k.startswith("model.layers.4.hc_head") for k in state)
        worst = state_error(state, ref["state"], 1e-5, name)
        moved = [k for k in state if k.startswith("model.layers.4.") and k.endswith("e_score_correction_bias")]
        assert moved and float((state[moved[0]] - start.state_dict()[moved[0]]).abs().max()) > 0
        errs = {key: max(_rel(g, w) for res in results for g, w in zip(res[name][key], ref[key]))
                for key in ("losses", "mtp", "aux")}
        print(name, "loss error", errs["losses"], "mtp error", errs["mtp"], "aux error", errs["aux"],
              "worst weight error", worst, "mtp loss", ref["mtp"])


class _Layout:
    def size(self, name):
        return 1


def test_unscaled_deepseek4_configs_run_mtp(capsys):
    """The wheel YAMLs as written: MTP depth 1 with scale 0.3 reaches the family, which accepts it (the refusal is
    gone); they plan at their own world; their compress_ratios hold one entry per decoder layer plus the MTP layer's,
    0 (a sliding-window layer: deepseek4_mtp.MTP_ATTENTION). Legacy MTP (use_legacy: true) is refused by its key."""
    import warnings

    import torch

    import msparallel_ds as msp
    from msparallel_ds.cli import main
    from msparallel_ds.models import adapter_for
    from msparallel_ds.models.deepseek4_mtp import MTP_ATTENTION
    from msparallel_ds.strategy import Options

    from msparallel_ds.strategy import _add_mtp

    model = v4_model()
    adapter = adapter_for(model)
    _add_mtp(model, _Layout(), 1, adapter)  # msp.initialize's path at pp=1: the family's MTP layer, seeded
    want = mtp_model(with_layer=True).state_dict()
    assert type(model.model.layers[4]).__name__ == "DeepseekV4MTPLayer" and model.config.num_nextn_predict_layers == 1
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items() if k != ROUTER)
    for name in V4:
        doc = yaml.safe_load((FIXTURES / name).read_text())
        m = doc["model"]
        ratios, n, depth = m["compress_ratios"], m["num_hidden_layers"], m["num_nextn_predict_layers"]
        assert depth == 1 and len(ratios) == n + depth and ratios[n:] == [0] and MTP_ATTENTION == "sliding_attention"
        world = 16 if name == V4[3] else 8
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = msp.make_plan(doc, world_size=world)
        options = Options.from_plan(plan)
        assert (options.mtp_depth, options.mtp_scale, options.mtp_legacy) == (1, 0.3, False), name
        adapter.check_options(_Layout(), options)  # no longer refused
        assert main(["plan", str(FIXTURES / name), "--world-size", str(world), "--format", "json"]) == 0
        capsys.readouterr()
    with pytest.raises(ValueError, match="use_legacy"):
        adapter.check_options(_Layout(), Options(mtp_depth=1, mtp_legacy=True))


def test_every_depth_embeds_the_ids_shifted_by_one():
    """Depth 2 (num_nextn_predict_layers: 2): MindFormers 2.1's block hands every MTP layer the original input_ids,
    which each rolls by one (multi_token_prediction.py:460, 605-616), so depth 2 embeds ids << 1 too (not ids << 2, as
    Megatron and models/mtp.py's other families), on depth 1's output; its own layer N + 1, sliding, top-k."""
    import torch
    from transformers.masking_utils import create_sliding_window_causal_mask

    from msparallel_ds.models.deepseek4_mtp import make_mtp_layer
    from msparallel_ds.models.mtp import add_mtp_layers, run_depths, shift_left

    model = v4_model()
    layers = add_mtp_layers(model, 2, make_mtp_layer)
    assert [layer.self_attn.layer_type for layer in layers] == ["sliding_attention"] * 2
    assert [type(layer.mlp.gate).__name__ for layer in layers] == ["DeepseekV4TopKRouter"] * 2
    ids = global_batch(0, 2)[0]
    base = model.model
    with torch.no_grad():
        h = base(input_ids=ids).last_hidden_state
        pos = torch.arange(ids.shape[1])[None].expand(2, -1)
        rope = {k: base.rotary_emb(h, position_ids=pos, layer_type=k) for k in ("main", "compress")}
        mask = create_sliding_window_causal_mask(config=model.config, inputs_embeds=h, attention_mask=None, cache=None,
                                                 position_ids=pos)
        ctx = dict(position_embeddings=rope, position_ids=pos, attention_mask=mask)
        shifted = [shift_left(ids, k, 0) for k in (1, 2)]  # what models.mtp.mtp_inputs hands the depths
        got = run_depths(layers, base.embed_tokens, h, shifted, ctx, hidden_first=False)

        def depth(layer, h, ids_k):
            x = layer.eh_proj(torch.cat([layer.enorm(base.embed_tokens(ids_k)), layer.hnorm(h)], -1))
            x = layer(x[:, :, None].repeat(1, 1, model.config.hc_mult, 1), mtp=True, **ctx)
            return layer.shared_head.norm(layer.hc_head(x))

        first = depth(layers[0], h, shifted[0])
        assert torch.equal(got[0], first)
        assert torch.equal(got[1], depth(layers[1], first, shifted[0]))
        assert not torch.allclose(got[1], depth(layers[1], first, shifted[1]))
