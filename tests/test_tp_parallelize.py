"""tp_parallelize on a HF Llama: logits, loss and every weight grad equal the unsharded model's (tp=4 replicates the
2 kv heads; dp2 x tp2 splits them), with and without vocab parallel; clear errors for what is not supported."""
from types import SimpleNamespace

import pytest
from harness import run_distributed
from models import tiny_llama

# (dp, tp, vocab_parallel, sequence_parallel)
CASES = [(1, 4, False, False), (1, 4, True, True), (1, 4, False, True), (2, 2, False, False), (2, 2, True, False),
         (2, 2, True, True), (2, 2, False, True)]
QWEN3_CASES = [(1, 4, True, True), (2, 2, False, False), (2, 2, False, True)]


def tiny_qwen3():
    """Qwen3 adds per-head q_norm/k_norm (replicated weights, grads summed over tp) and tied embeddings."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    return Qwen3ForCausalLM(cfg).float()


def tiny_qwen2():
    """Qwen2: q/k/v with bias (column shards of the bias)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).float()


def tiny_mistral():
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        sliding_window=None, attn_implementation="eager")
    return MistralForCausalLM(cfg).float()


def _tp_parity(rank, world_size, cases, build=tiny_llama):
    import torch

    from msparallel_ds.distributed import init_parallel
    from msparallel_ds.tensor_parallel.apply import (
        tp_parallelize,
        vocab_parallel_causal_lm_loss,
    )
    from msparallel_ds.distributed.collectives import all_gather_along

    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 64, (2, 16), generator=g)
    labels = input_ids.clone()
    labels[0, 5] = -100
    ref = build()
    out = ref(input_ids=input_ids, labels=labels)
    out.loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    results = {}
    for dp, tp, vocab, sp in cases:
        lay = init_parallel(SimpleNamespace(world_size=world_size,
                                            mesh=dict(pp=1, dp=dp, cp_ring=1, cp_ulysses=1, tp=tp)))
        tpg = lay.group("tp")
        model = tp_parallelize(build(), lay, vocab_parallel=vocab, sequence_parallel=sp)
        n_sharded = sum(getattr(p, "tensor_model_parallel", False) for p in model.parameters())
        seen = []  # the residual stream's sequence length at a norm: 16/tp under SP
        model.model.layers[-1].post_attention_layernorm.register_forward_hook(
            lambda mod, args, out: seen.append(args[0].shape[1]))
        res = model(input_ids=input_ids, labels=labels)
        res.loss.backward()
        logits = res.logits.detach()
        helper_err = 0.0
        if vocab:
            helper_err = abs(vocab_parallel_causal_lm_loss(logits, labels, lay).item() - out.loss.item())
            logits = all_gather_along(logits, tpg, -1)
        err_grad, names = 0.0, set()
        for n, p in model.named_parameters():
            grad = p.grad
            if getattr(p, "tensor_model_parallel", False):
                grad = all_gather_along(grad, tpg, p.partition_dim)
            names.add(n)
            err_grad = max(err_grad, (grad - ref_grads[n]).abs().max().item())
        results[(dp, tp, vocab, sp)] = {"loss": abs(res.loss.item() - out.loss.item()), "helper": helper_err,
                                    "logits": (logits - out.logits.detach()).abs().max().item(), "grad": err_grad,
                                    "same_names": names == set(ref_grads), "n_sharded": n_sharded,
                                    "norm_seq": seen}
    return results


@pytest.mark.distributed
def test_hf_llama_tensor_parallel_matches_unsharded():
    results = run_distributed(_tp_parity, 4, CASES, timeout=300)
    for rank, per_case in enumerate(results):
        assert set(per_case) == set(CASES)
        for case, err in per_case.items():
            assert err["same_names"], (rank, case)
            # q, o, gate, up, down per layer (+ k, v when tp divides kv heads) (+ embedding, lm_head)
            assert err["n_sharded"] == 2 * (5 + 2 * (case[1] == 2)) + 2 * case[2], (rank, case, err)
            assert err["norm_seq"] == [16 // case[1] if case[3] else 16], (rank, case, err)
            assert err["loss"] < 1e-5 and err["helper"] < 1e-5 and err["logits"] < 1e-5 and err["grad"] < 1e-5, \
                (rank, case, err)


@pytest.mark.distributed
def test_hf_qwen3_tensor_parallel_matches_unsharded():
    results = run_distributed(_tp_parity, 4, QWEN3_CASES, tiny_qwen3, timeout=300)
    for rank, per_case in enumerate(results):
        for case, err in per_case.items():
            assert err["same_names"], (rank, case)
            assert err["loss"] < 1e-5 and err["helper"] < 1e-5 and err["logits"] < 1e-5 and err["grad"] < 1e-5, \
                (rank, case, err)


@pytest.mark.distributed
@pytest.mark.parametrize("build", [tiny_qwen2, tiny_mistral])
def test_hf_qwen2_and_mistral_tensor_parallel_match_unsharded(build):
    results = run_distributed(_tp_parity, 4, [(1, 4, True, True), (2, 2, False, True)], build, timeout=300)
    for rank, per_case in enumerate(results):
        for case, err in per_case.items():
            assert err["same_names"] and err["norm_seq"] == [16 // case[1]], (rank, case, err)
            assert err["loss"] < 1e-5 and err["helper"] < 1e-5 and err["logits"] < 1e-5 and err["grad"] < 1e-5, \
                (rank, case, err)


# ---------------------------------------------------------------------------------------------- errors
def _fake_layout(tp):
    return SimpleNamespace(size=lambda name: tp if name == "tp" else 1, group=lambda name: None)


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    import torch

    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(num_hidden_layers=2, hidden_size=16, ffn_dim=32, num_attention_heads=2,
                                    vocab_size=32, max_position_embeddings=16, word_embed_proj_dim=16,
                                    dropout=0.0, attention_dropout=0.0))


def test_unsupported_architecture_names_the_supported_ones():
    from types import SimpleNamespace

    from msparallel_ds.models import adapter_for_config
    from msparallel_ds.tensor_parallel.apply import tp_parallelize

    with pytest.raises(ValueError, match="unsupported architecture OPTForCausalLM.*LlamaForCausalLM.*Qwen3.*Glm"
                                         ".*GPT2LMHeadModel.*recompute: true.*model_parallel > 1"):
        tp_parallelize(_opt(), _fake_layout(2))
    for arch, model_type, family in (("TelechatForCausalLM", "telechat", "TeleChat"),
                                     ("BaichuanForCausalLM", "baichuan", "Baichuan"),
                                     ("InternLM2ForCausalLM", "internlm2", "InternLM"),
                                     ("WhisperForConditionalGeneration", "whisper", "Whisper"),
                                     ("CogVLMForCausalLM", "cogvlm2", "CogVLM2")):
        with pytest.raises(ValueError, match=rf"unsupported architecture {family} \({arch}.*these run: "
                                             r"parallel_config.data_parallel.*context_parallel.*These need an "
                                             r"adapter: parallel_config.model_parallel > 1"):
            adapter_for_config(SimpleNamespace(model_type=model_type, architectures=[arch]))


def _dp_only_opt(rank, world_size):
    import torch

    import msparallel_ds as msp
    from msparallel_ds.strategy import applied_to

    model = _opt()
    layout = msp.init_parallel(msp.load_config({"parallel_config": {"data_parallel": world_size},
                                                "recompute_config": {"recompute": True}}))
    msp.parallelize(model, layout)
    done = applied_to(model)
    ids = torch.arange(24).reshape(2, 12) % 32
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    ref = _opt().train()
    ref(input_ids=ids, labels=ids).loss.backward()
    grads = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    refused = None
    try:  # per-stage counts need the adapter's layer list: refused naming the keys
        msp.parallelize(_opt(), msp.init_parallel(msp.load_config(
            {"parallel_config": {"data_parallel": world_size}, "recompute_config": {"recompute": [1]}})))
    except ValueError as e:
        refused = str(e)
    return (done.adapter, done.output_head(model) is model.lm_head, len(done.spec.split_names()), done.recompute,
            model.model.decoder.gradient_checkpointing, grads, refused)


def test_a_family_without_adapter_still_runs_data_parallel():
    """Only tp, pp, ep, per-stage/select recompute and interleave need the family adapter; dp / ZeRO / cp and
    whole-layer recompute (the model's own HF gradient checkpointing) run any HF causal LM."""
    for adapter, head_found, split, recompute, hf_gc, grads, refused in run_distributed(_dp_only_opt, 2,
                                                                                          timeout=120):
        assert adapter is None and head_found and split == 0
        assert recompute == {"0": [""], "1": [""]} and hf_gc and grads <= 1e-6, (recompute, hf_gc, grads)
        assert "recompute_config.recompute as per-stage counts" in refused, refused


@pytest.mark.parametrize("tp, match", [
    (3, "num_attention_heads=4 is not divisible by the tensor-parallel size tp=3"),
    (8, "num_attention_heads=4 is not divisible by the tensor-parallel size tp=8"),
])
def test_head_counts_that_do_not_divide(tp, match):
    from msparallel_ds.tensor_parallel.apply import tp_parallelize

    with pytest.raises(ValueError, match=match):
        tp_parallelize(tiny_llama(), _fake_layout(tp))


def test_kv_heads_neither_divisible_nor_multiple():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from msparallel_ds.tensor_parallel.apply import tp_parallelize

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=6, num_key_value_heads=3))
    with pytest.raises(ValueError, match="num_key_value_heads=3 and the tensor-parallel size tp=2"):
        tp_parallelize(model, _fake_layout(2))


def test_plan_starts_from_hf_tp_plan():
    from msparallel_ds.tensor_parallel.apply import tp_plan

    model = tiny_llama()
    plan = tp_plan(model, _fake_layout(2), vocab_parallel=True)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["model.embed_tokens"] == "vocab_embedding" and plan["lm_head"] == "vocab_lm_head"
    replicated = tp_plan(model, _fake_layout(4))
    assert replicated["model.layers.*.self_attn.k_proj"] == "colwise_kv_replicated"
    sp = tp_plan(model, _fake_layout(2), sequence_parallel=True)
    assert sp["model.layers.*.self_attn"] == sp["model.layers.*.mlp"] == "sequence_gather_input"
    assert sp["model.layers.*.input_layernorm"] == sp["model.layers.*.post_attention_layernorm"] == \
        sp["model.norm"] == "sequence_parallel"
    assert sp["model.layers.0"] == "sequence_scatter_input"
    assert sp["lm_head"] == "sequence_gather_input_replicated"
    assert tp_plan(model, _fake_layout(2), sequence_parallel=True, vocab_parallel=True)["lm_head"] == "vocab_lm_head"
