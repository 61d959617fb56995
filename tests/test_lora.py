"""model_config.pet_config (MindFormers LoRA) through msp.initialize: peft LoRA on the cells target_modules names
(MindFormers cell names mapped by the adapter), only the LoRA weights train; under dp2 (ZeRO-1), cp2 and pp2 the
losses and LoRA weights of 3 steps equal one process's, and the base weights stay as loaded. tp and the other PET
types are one clear error naming the key."""
import pytest

from engine_cases import LR, BETAS, EPS, global_batch, tiny_config, tiny_model
from harness import run_distributed

STEPS = 3
PET = {"pet_type": "lora", "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ".*wq|.*wv|.*w2"}


def _config(**kw):
    pp = kw.pop("pp", 1)
    c = tiny_config(**kw)
    c["model"]["model_config"]["pet_config"] = dict(PET)
    if pp > 1:
        c["parallel_config"].update(pipeline_stage=pp, micro_batch_num=2)
    return c


def _reference(rows, settings):
    """One process: peft LoRA (the same injection), AdamW on the LoRA weights, clip 1.0, global-batch mean loss."""
    import torch

    from msparallel_ds.pet import apply_lora

    model = apply_lora(tiny_model(), settings)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        ids, labels = global_batch(step, rows)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _cases(rank, world_size, save_dir):
    import torch

    import msparallel_ds as msp

    base = tiny_model().state_dict()
    out = {}
    for name, kw in {"dp2-zero1": dict(dp=2, zero=1), "cp2": dict(cp=2), "pp2": dict(pp=2)}.items():
        cfg = msp.load_config(_config(**kw))
        engine = msp.initialize(tiny_model(), cfg, optimizer=lambda p: torch.optim.AdamW(
            p, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0))
        lay = engine.layout
        rows = engine.micro_batch_size * engine.gradient_accumulation_steps
        dp, d = lay.size("dp"), lay.rank("dp")
        losses = []
        for step in range(STEPS):
            ids, labels = global_batch(step, rows * dp)
            share = slice(d * rows, (d + 1) * rows)
            losses.append(engine.train_batch({"input_ids": ids[share], "labels": labels[share]}).item())
        state = {k: v.clone() for k, v in engine.full_state_dict().items()}  # before the resume step below
        ref_losses, ref_state = _reference(rows * dp, cfg.pet)
        if name == "dp2-zero1":  # save_pretrained: plain HF weights with the adapters merged (W + B A alpha/r)
            from transformers import AutoModelForCausalLM

            engine.save_pretrained(save_dir)
            saved = AutoModelForCausalLM.from_pretrained(save_dir, dtype=torch.float32).state_dict()
            q = "model.layers.1.self_attn.q_proj."
            merged = ref_state[q + "base_layer.weight"] + ref_state[q + "lora_B.default.weight"] @ ref_state[
                q + "lora_A.default.weight"] * 2.0
            engine.save(save_dir + "-engine")  # resume: a fresh LoRA engine loads it and takes the same next step
            again = msp.initialize(tiny_model(), cfg, optimizer=lambda p: torch.optim.AdamW(
                p, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0))
            again.load(save_dir + "-engine")
            ids, labels = global_batch(STEPS, rows * dp)
            share = slice(d * rows, (d + 1) * rows)
            nxt = [e.train_batch({"input_ids": ids[share], "labels": labels[share]}).item() for e in (engine, again)]
            out["resume"] = abs(nxt[0] - nxt[1])
            out["merged"] = {"q": (saved[q + "weight"] - merged).abs().max().item(), "keys": set(saved) == set(base),
                             "k": (saved["model.layers.1.self_attn.k_proj.weight"]
                                   - base["model.layers.1.self_attn.k_proj.weight"]).abs().max().item()}
        lora = [k for k in ref_state if ".lora_" in k]
        out[name] = {
            "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "lora": max((state[k] - ref_state[k]).abs().max().item() for k in lora),
            "lora_moved": max((ref_state[k] - (0 if "lora_B" in k else ref_state[k])).abs().max().item()
                              for k in lora),
            "base": max((state[k] - base[k.replace(".base_layer", "")]).abs().max().item()
                        for k in state if ".lora_" not in k),
            "keys": set(state) == set(ref_state), "n_lora": len(lora),
        }
    return out


@pytest.mark.distributed
def test_lora_trains_only_lora_weights_under_dp_cp_pp(tmp_path):
    for rank_result in run_distributed(_cases, 2, str(tmp_path / "hf"), timeout=400):
        merged = rank_result.pop("merged")
        assert rank_result.pop("resume") <= 1e-6
        assert merged["keys"] and merged["q"] <= 1e-6 and merged["k"] == 0.0, merged
        for name, r in rank_result.items():
            assert r["keys"] and r["n_lora"] == 4 * 3 * 2, (name, r)
            assert r["loss"] <= 1e-5 and r["lora"] <= 1e-5, (name, r)
            assert r["base"] == 0.0, (name, r)       # frozen: bit-identical to the loaded weights
            assert r["lora_moved"] > 1e-4, (name, r)  # B left zero: the LoRA path really trained


def test_lora_cells_scaling_and_init():
    """'.*wq|.*wv|.*w2' (MindFormers legacy names) -> q_proj, v_proj, down_proj; mcore names the same HF modules;
    scaling alpha/rank; A ~ N(0, 0.01), B = 0, so the model starts as the base model; base frozen."""
    import torch

    import msparallel_ds as msp
    from msparallel_ds.models import adapter_for
    from msparallel_ds.pet import apply_lora

    cfg = msp.load_config(_config())
    model = apply_lora(tiny_model(), cfg.pet)
    q = model.model.layers[0].self_attn.q_proj
    assert q.scaling["default"] == 8 / 4
    a = torch.cat([p.flatten() for n, p in model.named_parameters() if "lora_A" in n])
    assert abs(a.std().item() - 0.01) < 1e-3 and all(
        not p.any() for n, p in model.named_parameters() if "lora_B" in n)
    ids = torch.arange(16)[None]
    assert torch.equal(model(ids).logits, tiny_model()(ids).logits)
    assert {n.split(".")[-1] for n in adapter_for(model).lora_targets(tiny_model(), ".*wq|.*wv|.*w2")} == {
        "q_proj", "v_proj", "down_proj"}
    mcore = adapter_for(model).lora_targets(tiny_model(), ".*linear_qkv|.*linear_fc2", (".*fc2",))
    assert {n.split(".")[-1] for n in mcore} == {"q_proj", "k_proj", "v_proj"}
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == sorted(
        n for n, _ in model.named_parameters() if ".lora_" in n)
    with pytest.raises(ValueError, match="target_modules='.*nothing' matches no linear cell"):
        apply_lora(tiny_model(), msp.load_config(
            {**_config(), "model": {"model_config": {**_config()["model"]["model_config"],
                                                     "pet_config": {**PET, "target_modules": ".*nothing"}}}}).pet)


@pytest.mark.parametrize("pet, layout, words", [
    ({"pet_type": "ptuning2", "pre_seq_len": 8}, {}, "pet_config.pet_type='ptuning2' is not built"),
    ({"pet_type": "prefixtuning"}, {}, "pet_config.pet_type='prefixtuning' is not built"),
    (PET, {"tp": 2}, "pet_config.pet_type='lora' with parallel_config.model_parallel=2"),
    ({**PET, "lora_rank": 0}, {}, "lora_rank=0 must be a positive integer"),
    ({**PET, "target_modules": "(.*wq"}, {}, "target_modules='\\(.\\*wq' is not a regular expression"),
    ({**PET, "freeze_include": ["*"]}, {}, "freeze_include"),
])
def test_pet_config_errors(pet, layout, words):
    import msparallel_ds as msp

    c = tiny_config(**layout)
    c["model"]["model_config"]["pet_config"] = pet
    with pytest.raises(msp.ConfigError, match=words):
        msp.load_config(c)


def test_accelerate_path_refuses_pet_config_without_lora():
    """MindFormersAccelerator._prepare_deepspeed calls require_lora: there the optimizer predates the model, so a
    pet_config whose LoRA was not applied first is an error, not a silent full fine-tune."""
    import msparallel_ds as msp
    from msparallel_ds.pet import apply_lora, require_lora

    settings = msp.load_config(_config()).pet
    with pytest.raises(ValueError, match="pet_config .* has no LoRA layers.*apply_lora"):
        require_lora(tiny_model(), settings)
    require_lora(apply_lora(tiny_model(), settings), settings)
    require_lora(tiny_model(), None)
