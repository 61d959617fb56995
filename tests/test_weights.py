"""HF checkpoints and tensor parallel: from_pretrained loads only each rank's shards and gives the unsharded logits;
save_pretrained of a trained tp model writes a plain HF checkpoint that a single process reloads to the same logits;
clear errors for a missing key, a wrong shape and a .bin checkpoint."""
import json
from types import SimpleNamespace

import pytest
from harness import run_distributed
from models import tiny_llama
from test_tp_parallelize import tiny_qwen3

# (dp, tp, vocab_parallel, sequence_parallel); SP puts grad all-reduce hooks on the norms, which loading must keep
LOAD_CASES = {"llama": [(1, 4, False, False), (1, 4, True, False), (2, 2, False, False), (2, 2, True, False),
                        (1, 4, True, True)],
              "qwen3": [(1, 4, True, False), (2, 2, False, True)]}
TOL = 1e-6


def _ids():
    import torch

    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def _layout(world_size, dp, tp):
    from msparallel_ds.distributed import init_parallel

    return init_parallel(SimpleNamespace(world_size=world_size,
                                         mesh={"pp": 1, "dp": dp, "cp_ring": 1, "cp_ulysses": 1, "tp": tp}))


def _tp(vocab, sp=False):
    from msparallel_ds.tensor_parallel.apply import tp_parallelize

    return lambda model, layout: tp_parallelize(model, layout, vocab_parallel=vocab, sequence_parallel=sp)


def _full_logits(model, layout, vocab):
    import torch

    from msparallel_ds.distributed.collectives import all_gather_along

    with torch.no_grad():
        logits = model(input_ids=_ids()).logits
    return all_gather_along(logits, layout.group("tp"), -1) if vocab else logits


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return None


# ---------------------------------------------------------------------------------------------- load
def _grad_error(model, layout, ref_grads):
    """Loaded models train: weight grads (tp-sharded ones gathered) equal the unsharded model's. This covers the
    Qwen3 q_norm/k_norm grad all-reduce hooks, which live on the Parameters the loader replaces."""
    from msparallel_ds.distributed.collectives import all_gather_along

    model(input_ids=_ids(), labels=_ids()).loss.backward()
    err = 0.0
    for n, p in model.named_parameters():
        grad = p.grad
        if getattr(p, "tensor_model_parallel", False):
            grad = all_gather_along(grad, layout.group("tp"), p.partition_dim)
        err = max(err, (grad - ref_grads[n]).abs().max().item())
    return err


def _load(rank, world_size, dirs, refs):
    from msparallel_ds.checkpoint.hf import from_pretrained

    results = {}
    for name, cases in LOAD_CASES.items():
        for dp, tp, vocab, sp in cases:
            lay = _layout(world_size, dp, tp)
            model = from_pretrained(dirs[name], lay, parallelize_fn=_tp(vocab, sp))
            sharded = [p for p in model.parameters() if getattr(p, "tensor_model_parallel", False)]
            tensors = [*model.parameters(), *model.buffers()]
            results[(name, dp, tp, vocab, sp)] = {
                "logits": (_full_logits(model, lay, vocab) - refs[name]["logits"]).abs().max().item(),
                "grad": _grad_error(model, lay, refs[name]["grads"]),
                "n_sharded": len(sharded),
                "own_storage": all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in sharded),
                "meta": [t.shape for t in tensors if t.is_meta],
                "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                "requires_grad": all(p.requires_grad for p in model.parameters()),
                "training": model.training}
    lay = _layout(world_size, 2, 2)
    results["missing"] = _error(lambda: from_pretrained(dirs["missing"], lay, parallelize_fn=_tp(True)))
    results["shape"] = _error(lambda: from_pretrained(dirs["shape"], lay, parallelize_fn=_tp(False)))
    results["bin"] = _error(lambda: from_pretrained(dirs["bin"], lay, parallelize_fn=_tp(False)))
    return results


def _broken_copies(src, tmp_path):
    """Copies of a llama checkpoint with one key dropped, one q_proj of the wrong shape, and .bin weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    state = load_file(src / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    variants = {"missing": {k: v for k, v in state.items() if k != "model.layers.1.mlp.down_proj.weight"},
                "shape": {**state, key: state[key][:24].contiguous()}}
    dirs = {}
    for name, tensors in [*variants.items(), ("bin", None)]:
        d = tmp_path / name
        d.mkdir()
        shutil.copy(src / "config.json", d)
        if tensors is None:
            (d / "pytorch_model.bin").write_bytes(b"")
        else:
            save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        dirs[name] = str(d)
    return dirs


# ---------------------------------------------------------------------------------------------- save
def _train_and_save(rank, world_size, dirs):
    import torch

    from msparallel_ds.integrations.hf_attention import use_cp_attention
    from msparallel_ds.checkpoint.hf import from_pretrained, save_pretrained

    out = {}
    for name, build, dp, tp, shard_size in (("llama", tiny_llama, 2, 2, "30KB"), ("qwen3", tiny_qwen3, 1, 4, None)):
        lay = _layout(world_size, dp, tp)
        model = _tp(True)(build(), lay)
        model(input_ids=_ids(), labels=_ids()).loss.backward()
        with torch.no_grad():  # one SGD step: every replica gets the same update
            for p in model.parameters():
                p -= 0.5 * p.grad
        logits = _full_logits(model, lay, True)
        use_cp_attention(model, lay)  # the saved config must still be the plain architecture's
        kwargs = {"max_shard_size": shard_size} if shard_size else {}
        save_pretrained(model, lay, dirs[f"{name}_out"], **kwargs)
        reloaded = from_pretrained(dirs[f"{name}_out"], lay, parallelize_fn=_tp(False))  # our loader, on the output
        out[name] = {"logits": logits, "reload": (_full_logits(reloaded, lay, False) - logits).abs().max().item()}
    return out


# ---------------------------------------------------------------------------------------------- one run, two tests
def _both(rank, world_size, dirs, refs):
    return {"load": _load(rank, world_size, dirs, refs), "save": _train_and_save(rank, world_size, dirs)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Reference checkpoints written by HF in this process, then ONE 4-rank job for both tests: spawning the ranks
    and importing transformers there dominate the time."""
    tmp = tmp_path_factory.mktemp("weights")
    dirs, refs = {}, {}
    for name, build in (("llama", tiny_llama), ("qwen3", tiny_qwen3)):
        model = build()
        model.save_pretrained(tmp / name)
        dirs[name] = str(tmp / name)
        out = model(input_ids=_ids(), labels=_ids())
        out.loss.backward()
        refs[name] = {"logits": out.logits.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}
    dirs.update(_broken_copies(tmp / "llama", tmp))
    dirs.update({f"{name}_out": str(tmp / f"{name}_out") for name in ("llama", "qwen3")})
    results = run_distributed(_both, 4, dirs, refs, timeout=150)
    return SimpleNamespace(tmp=tmp, dirs=dirs, load=[r["load"] for r in results], save=[r["save"] for r in results])


@pytest.mark.distributed
def test_from_pretrained_loads_shards_and_matches_unsharded(run):
    for rank, res in enumerate(run.load):
        for (name, dp, tp, vocab, sp), r in ((k, v) for k, v in res.items() if isinstance(k, tuple)):
            case = (rank, name, dp, tp, vocab, sp, r)
            assert r["logits"] <= TOL and r["grad"] <= 1e-5 and r["own_storage"] and not r["meta"], case
            # q, o, gate, up, down per layer (+ k, v when tp divides the 2 kv heads); embedding + lm_head one tied
            # Parameter for qwen3 (two for llama)
            n_vocab = 0 if not vocab else 1 if name == "qwen3" else 2
            assert r["n_sharded"] == 2 * (5 + 2 * (tp == 2)) + n_vocab, case
            assert r["tied"] == (name == "qwen3") and r["requires_grad"] and not r["training"], case
        assert "model.layers.1.mlp.down_proj.weight" in res["missing"], res["missing"]
        assert "model.layers.0.self_attn.q_proj.weight" in res["shape"] and "(24, 32)" in res["shape"] \
            and "(16, 32)" in res["shape"] and "(32, 32)" in res["shape"], res["shape"]
        assert ".bin" in res["bin"] and "safetensors" in res["bin"], res["bin"]


@pytest.mark.distributed
def test_save_pretrained_round_trip_through_plain_hf(run):
    import torch
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    assert len(list((run.tmp / "llama_out").glob("model-*-of-*.safetensors"))) > 1  # the index path was exercised
    for name, cls in (("llama", LlamaForCausalLM), ("qwen3", Qwen3ForCausalLM)):
        config = json.loads((run.tmp / f"{name}_out" / "config.json").read_text())
        assert config["model_type"] == name and config["architectures"] == [cls.__name__], config
        assert not any("attn_implementation" in k for k in config), config
        model = cls.from_pretrained(run.dirs[f"{name}_out"])  # plain, single process
        index = run.tmp / f"{name}_out" / "model.safetensors.index.json"
        if index.exists():  # HF counts the saving rank's shards; weights.py writes the full model's count
            total = json.loads(index.read_text())["metadata"]["total_parameters"]
            assert total == sum(p.numel() for p in model.parameters()), total
        with torch.no_grad():
            ref = model(input_ids=_ids()).logits
        for rank, res in enumerate(run.save):
            assert (res[name]["logits"] - ref).abs().max().item() <= TOL, (name, rank)
            assert res[name]["reload"] <= TOL, (name, rank, res[name]["reload"])
        if name == "qwen3":  # tied: the checkpoint holds the embedding only, and the reload ties lm_head to it
            assert model.lm_head.weight is model.model.embed_tokens.weight


# ---------------------------------------------------------------------------------------------- one process
def test_unsharded_load_concrete_class_dtype_and_in_place(tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    from msparallel_ds.checkpoint.hf import from_pretrained, load_sharded_checkpoint

    layout = SimpleNamespace(size=lambda name: 1, rank=lambda name: 0, device_type="cpu")  # no process group
    ref = tiny_llama()
    ref.save_pretrained(tmp_path)
    with torch.no_grad():
        expected = ref(input_ids=_ids()).logits

    model = from_pretrained(tmp_path, layout, parallelize_fn=None, model_cls=LlamaForCausalLM,
                            attn_implementation="eager")
    assert type(model) is LlamaForCausalLM and model.config._attn_implementation == "eager"
    with torch.no_grad():
        assert (model(input_ids=_ids()).logits - expected).abs().max().item() <= TOL

    half = from_pretrained(tmp_path, layout, parallelize_fn=None, dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert half.model.rotary_emb.inv_freq.dtype == torch.float32  # recomputed in fp32, as HF keeps it

    target = LlamaForCausalLM(ref.config)  # real tensors, other values: filled in place, same Parameter objects
    params = list(target.parameters())
    load_sharded_checkpoint(target, tmp_path, layout)
    assert all(a is b for a, b in zip(params, target.parameters(), strict=True))
    with torch.no_grad():
        assert (target(input_ids=_ids()).logits - expected).abs().max().item() <= TOL


def test_saved_config_drops_a_custom_attention_name(tmp_path):
    """transformers 5.23 does not write the attention name; versions that do must not leave ours in config.json."""
    from msparallel_ds.checkpoint.hf import clean_saved_config as _clean_saved_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "_attn_implementation": "msparallel_cp",
                                                      "attn_implementation": "msparallel_cp"}))
    _clean_saved_config(str(tmp_path), 0)
    assert json.loads((tmp_path / "config.json").read_text()) == {"model_type": "llama"}
