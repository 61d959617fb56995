"""GPT-2 LoRA with MindFormers' cell names (configs gpt2/run_gpt2_lora.yaml, run_gpt2_xl_lora.yaml,
finetune_gpt2_small_lora_fp16.yaml: target_modules '.*dense1.*|.*dense3.*'). MindFormers' attention.dense1/2/3 are
separate q/k/v Linears, each replaced by its own LoRADense; HF fuses them in c_attn, so the LoRA is one per column
block of c_attn (pet.BlockLora), not one on the fused weight. Checked: the cells matched follow MindFormers' walk,
the LoRA model equals the MindFormers-structured model (q/k/v split by the GPT-2 weight map, W_q + B_q A_q
alpha/r, W_v likewise, joined back), only LoRA weights get gradients, the merged HF weights give the same logits,
and dp2 (ZeRO-1) training through msp.initialize equals one process."""
import pytest

from engine_cases import BETAS, LR, global_batch, tiny_config
from family_cases import tiny_family
from harness import run_distributed

PET = {"pet_type": "lora", "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0,
       "target_modules": ".*dense1.*|.*dense3.*"}
STEPS = 3


def _settings(**kw):
    from msparallel_ds.config.pet import LoraSettings

    return LoraSettings(4, 8.0, 0.0, kw.pop("target", PET["target_modules"]), tuple(kw.pop("exclude", ())))


def test_gpt2_lora_cells_follow_mindformers_walk():
    import msparallel_ds as msp
    from msparallel_ds.models import adapter_for
    from msparallel_ds.pet import apply_lora

    model = tiny_family("gpt2")
    a = adapter_for(model)
    blocks = a.lora_block_targets(model, PET["target_modules"])
    assert set(blocks) == {f"transformer.h.{i}.attn.c_attn" for i in range(4)}
    assert blocks["transformer.h.0.attn.c_attn"] == (("dense1", 0, 64), ("dense3", 128, 64))  # q and v columns
    assert a.lora_targets(model, PET["target_modules"]) == []
    assert {n.split(".", 3)[3] for n in a.lora_targets(model, ".*projection")} == {"attn.c_proj", "mlp.c_proj"}
    assert a.lora_targets(model, ".*projection", (".*output",)) == [f"transformer.h.{i}.attn.c_proj" for i in range(4)]
    assert a.lora_block_targets(model, "dense2", ("1",)) == {  # exclude_layers matches the layer's own name "1"
        f"transformer.h.{i}.attn.c_attn": (("dense2", 64, 64),) for i in (0, 2, 3)}
    # a matched cell that is no Linear is not entered (recursive_replace_dense_cell): '.*attention.*' replaces nothing
    with pytest.raises(ValueError, match="target_modules='.\\*attention.\\*' matches no linear cell"):
        apply_lora(tiny_family("gpt2"), _settings(target=".*attention.*"))
    cfg = msp.load_config({**tiny_config(), "model": {"model_config": {"pet_config": PET}}})
    assert cfg.pet.target_modules == PET["target_modules"] and cfg.pet.rank == 4


def test_gpt2_lora_equals_mindformers_separate_q_v_lora():
    import torch

    from msparallel_ds.checkpoint.weight_map import to_hf, to_mf
    from msparallel_ds.models import Gpt2Family
    from msparallel_ds.pet import apply_lora, merged_state_dict

    model = apply_lora(tiny_family("gpt2"), _settings())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g))
    ids = torch.randint(0, 64, (2, 16), generator=g)
    logits = model(ids).logits
    # MindFormers: dense1 (q) and dense3 (v) are LoRADense, y = x W^T + b + B(A x) * alpha/r, i.e. W + B A alpha/r
    plain = tiny_family("gpt2")
    cfg, ops = plain.config, Gpt2Family().mindformers_weights(plain.config, legacy=True)
    hf = {k: v for k, v in plain.state_dict().items() if k != "lm_head.weight"}
    mf = to_mf(ops, hf, cfg, fused=True)
    state = model.state_dict()
    for i in range(4):
        for cell in ("dense1", "dense3"):
            c = f"transformer.h.{i}.attn.c_attn.lora_"
            mf[f"backbone.blocks.{i}.attention.{cell}.weight"] += \
                state[f"{c}B.{cell}.weight"] @ state[f"{c}A.{cell}.weight"] * 2.0
    plain.load_state_dict(to_hf(ops, mf, cfg), strict=False)
    assert (plain(ids).logits - logits).abs().max().item() <= 1e-5
    merged = tiny_family("gpt2")
    merged.load_state_dict(merged_state_dict(model, model.state_dict()))
    assert (merged(ids).logits - logits).abs().max().item() <= 1e-5
    logits.sum().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads == {n for n, _ in model.named_parameters() if ".lora_" in n} and len(grads) == 4 * 2 * 2


def _reference(rows):
    import torch

    from msparallel_ds.pet import apply_lora

    model = apply_lora(tiny_family("gpt2", tied=True), _settings())
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=1e-8, weight_decay=0.0)
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


def _dp2(rank, world_size, _):
    import torch

    import msparallel_ds as msp

    c = tiny_config(dp=2, zero=1)
    c["model"]["model_config"]["pet_config"] = dict(PET)
    engine = msp.initialize(tiny_family("gpt2", tied=True), msp.load_config(c), optimizer=lambda p: torch.optim.AdamW(
        p, lr=LR, betas=BETAS, eps=1e-8, weight_decay=0.0))
    rows = engine.micro_batch_size * engine.gradient_accumulation_steps
    d = engine.layout.rank("dp")
    losses = []
    for step in range(STEPS):
        ids, labels = global_batch(step, 2 * rows)
        share = slice(d * rows, (d + 1) * rows)
        losses.append(engine.train_batch({"input_ids": ids[share], "labels": labels[share]}).item())
    state = engine.full_state_dict()
    ref_losses, ref = _reference(2 * rows)
    lora = [k for k in ref if ".lora_" in k]
    return {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)), "n_lora": len(lora),
            "lora": max((state[k] - ref[k]).abs().max().item() for k in lora),
            "moved": max(ref[k].abs().max().item() for k in lora if ".lora_B." in k),
            "base": max((state[k] - ref[k]).abs().max().item() for k in ref if ".lora_" not in k)}


@pytest.mark.distributed
def test_gpt2_lora_dp2_equals_one_process():
    for r in run_distributed(_dp2, 2, None, timeout=300):
        assert r["n_lora"] == 4 * 2 * 2 and r["loss"] <= 1e-5 and r["lora"] <= 1e-5, r
        assert r["base"] == 0.0 and r["moved"] > 1e-4, r
