"""Do the real MindFormers training YAMLs start? Each one, as a new user would try it: its parallel section scaled
to <= 8 processes, a tiny model of its family, `msp.initialize(model, yaml)` with the YAML's own optimizer and lr
schedule, 2 steps on random tokens. A survey, not a test: it prints one row per YAML and writes JSON.

    python benchmarks/configs_start.py [DIR ...] [--only SUBSTR] [--out benchmarks/results/configs_start.json]

DIRs are searched for *.yaml (default: the unpacked MindFormers 1.3.2 / 2.1.0 wheels' configs/ under /tmp/mf-*,
made with `pip download --no-deps mindformers==X` + unzip, and ../shared/mindformers-configs); identical files are
counted once. A YAML is a training YAML when run_mode is train or finetune, or it has the 2.1 `training:` section.
Status per YAML: ok (two finite steps), refused (a clear ValueError / ConfigError, its first line kept),
crash (any other exception), flagship (the DeepSeek flagship issue's configs, counted apart).
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import inspect
import json
import math
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_WORLD = 8
SEQ = 32

# model_config keys shrunk where present (legacy LlamaConfig / ChatGLM2Config / GPT2Config keys and 2.x HF keys)
_TINY = {"hidden_size": 64, "intermediate_size": 128, "ffn_hidden_size": 128, "moe_intermediate_size": 32,
         "moe_ffn_hidden_size": 32, "moe_shared_expert_intermediate_size": 32, "vocab_size": 256,
         "padded_vocab_size": 256, "seq_length": SEQ, "max_position_embedding": 2 * SEQ,
         "max_position_embeddings": 2 * SEQ, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
         "qk_nope_head_dim": 8, "v_head_dim": 16, "kv_channels": 8, "head_dim": 8, "multiple_of": 32,
         "num_experts_per_tok": 2, "num_experts_chosen": 2, "moe_router_topk": 2, "mtp_num_layers": 1}
_HEADS = ("num_heads", "num_attention_heads", "n_head")
_KV_HEADS = ("n_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_query_groups")
_LAYERS = ("num_layers", "num_hidden_layers", "n_layer")
_EXPERTS = ("num_experts", "n_routed_experts", "expert_num", "num_local_experts")
_FLAGSHIP = ("deepseek3_671b", "deepseek3_12b", "deepseek4", "deepseek3_1b")


def training_yamls(dirs: list[Path]) -> list[Path]:
    import yaml

    seen, out = set(), []
    for d in dirs:
        for path in sorted(d.rglob("*.yaml")):
            digest = hashlib.sha1(path.read_bytes()).hexdigest()
            if digest in seen or "convert_config" in path.parts:
                continue
            seen.add(digest)
            try:
                raw = yaml.safe_load(path.read_text())
            except yaml.YAMLError:
                continue
            if isinstance(raw, dict) and (raw.get("run_mode") in ("train", "finetune") or "training" in raw):
                out.append(path)
    return out


def _two(n) -> int:
    return 2 if isinstance(n, int) and n > 1 else 1


def scale(raw: dict) -> tuple[dict, int]:
    """The YAML with every parallel degree > 1 cut to 2 (dp dropped first past 8 processes), a tiny model of its
    family, batch 1 per micro-batch; returns (yaml dict, world size)."""
    r = copy.deepcopy(raw)
    pc = r.setdefault("parallel_config", {}) or {}
    deg = {k: _two(pc.get(k, 1)) for k in ("data_parallel", "model_parallel", "context_parallel", "pipeline_stage")}
    if math.prod(deg.values()) > MAX_WORLD:
        deg["data_parallel"] = 1
    pc.update(deg)
    for key in ("expert_parallel", "expert_model_parallel"):
        if key in pc:
            pc[key] = min(_two(pc[key]), deg["data_parallel"] * deg["model_parallel"] * deg["context_parallel"])
    if "ulysses_degree_in_cp" in pc:
        pc["ulysses_degree_in_cp"] = min(_two(pc["ulysses_degree_in_cp"]), deg["context_parallel"])
    pp = deg["pipeline_stage"]
    pc["micro_batch_num"] = max(pp, min(int(pc.get("micro_batch_num", 1) or 1), 2 * pp))
    rc = r.setdefault("runner_config", {}) or {}
    rc["batch_size"] = 1
    if "gradient_accumulation_steps" in rc:
        rc["gradient_accumulation_steps"] = min(int(rc["gradient_accumulation_steps"] or 1), 2)
    if "micro_batch_interleave_num" in r:
        r["micro_batch_interleave_num"] = min(int(r["micro_batch_interleave_num"] or 1), 2)
    vpp = int(((r.get("parallel") or {}).get("pipeline_config") or {}).get("pipeline_interleave") and
              (pc.get("pp_interleave_num") or (r.get("model") or {}).get("model_config", {}).get("pp_interleave_num"))
              or 1)
    mc = ((r.get("model") or {}).get("model_config")) or {}
    layers = max(2, 2 * pp * vpp)
    if r.get("use_legacy") is False:  # 2.x: sizes absent from the YAML came from pretrained_model_dir's config.json
        for key in ("hidden_size", "intermediate_size", "vocab_size", "head_dim"):
            mc.setdefault(key, _TINY[key])
        mc.setdefault("num_hidden_layers", 2)
        mc.setdefault("num_attention_heads", 8)
        mc.setdefault("num_key_value_heads", 4)
    mc.update({k: v for k, v in _TINY.items() if k in mc})
    mc.update({k: layers for k in _LAYERS if k in mc})
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "eod_token_id"):  # ids inside the tiny vocab
        if isinstance(mc.get(key), int) and mc[key] >= 256:
            mc[key] = 255 - ("pad_token_id", "bos_token_id", "eos_token_id", "eod_token_id").index(key)
    heads = 8
    mc.update({k: heads for k in _HEADS if k in mc})
    mha = all(mc.get(k) in (None, mc.get(_HEADS[0]), mc.get(_HEADS[1])) for k in _KV_HEADS)
    mc.update({k: (heads if mha else 4) for k in _KV_HEADS if k in mc and mc[k]})
    mc.update({k: 8 for k in _EXPERTS if isinstance(mc.get(k), int) and mc[k] > 1})
    if "n_group" in mc:
        mc["n_group"], mc["topk_group"] = min(int(mc["n_group"] or 1), 4), min(int(mc.get("topk_group") or 1), 2)
    if "first_k_dense_replace" in mc:
        mc["first_k_dense_replace"] = min(int(mc["first_k_dense_replace"] or 0), 1)
    mc.pop("offset", None)
    moe = r.get("moe_config") or {}
    if isinstance(moe.get("expert_num"), int) and moe["expert_num"] > 1:  # a real MoE (GLM YAMLs write expert_num: 1)
        moe.update({"expert_num": 8, **{k: 2 for k in ("num_experts_chosen",) if k in moe},
                    **{k: 32 for k in ("moe_intermediate_size",) if k in moe}})
    rec = r.get("recompute_config")
    def per_stage(d: dict) -> None:  # per-stage lists keep pp entries, each at most the layers of a stage
        for k, v in d.items():
            if isinstance(v, dict):  # select_recompute: {pattern: [per stage]}
                per_stage(v)
            elif isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                d[k] = [min(x, layers // pp) for x in v[:pp]]

    if isinstance(rec, dict):
        per_stage(rec)
    if not Path(str(r.get("pretrained_model_dir") or "")).is_dir():
        r.pop("pretrained_model_dir", None)  # a path on the machine that ran it
    world = math.prod(deg.values()) if r.get("use_parallel", True) else 1  # use_parallel: False runs on one device
    return r, world


def _worker(rank: int, world: int, yaml_path: str, send) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    import msparallel_ds as msp
    from msparallel_ds.checkpoint.mindformers_model import model_from_yaml

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_from_yaml(yaml_path).hf_config).float()
    kwargs = {"total_steps": 2} if "total_steps" in inspect.signature(msp.initialize).parameters else {}
    engine = msp.initialize(model, yaml_path, **kwargs)
    plan, lay = engine.plan, engine.layout
    rows = plan.global_batch_size // lay.size("dp")
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):
        ids = torch.randint(0, model.config.vocab_size, (plan.global_batch_size, SEQ), generator=g)
        d = lay.rank("dp")
        part = ids[d * rows:(d + 1) * rows]
        losses.append(float(engine.train_batch({"input_ids": part, "labels": part.clone()})))
    return losses


def _hf_folder(where: Path, moe: bool) -> str:
    """A tiny HF model folder (config.json only), what a user of the 2.1 general templates points
    pretrained_model_dir at: Qwen3 for the dense template, Qwen3-MoE for the MoE one."""
    from transformers import AutoConfig

    sizes = {k: _TINY[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "head_dim",
                                   "max_position_embeddings")}
    moe_sizes = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32} if moe else {}
    AutoConfig.for_model("qwen3_moe" if moe else "qwen3", num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=4, **sizes, **moe_sizes).save_pretrained(where)
    return str(where)


def try_one(path: Path, tmp: Path) -> dict:
    import warnings

    import yaml

    from msparallel_ds.launch import run_local

    raw = yaml.safe_load(path.read_text())
    row = {"yaml": str(path), "name": f"{path.parent.name}/{path.name}"}
    if any(f in path.name for f in _FLAGSHIP) or "parallelism" in raw:
        return {**row, "status": "flagship", "detail": "the DeepSeek flagship issue's configs"}
    scaled, world = scale(raw)
    mc = (scaled.get("model") or {}).get("model_config") or {}
    if scaled.get("use_legacy") is False and not mc.get("model_type"):  # 2.x YAML whose HF config sat in a folder
        if path.parent.name == "general":  # the 2.1 templates take any HF model folder as pretrained_model_dir
            scaled["pretrained_model_dir"] = _hf_folder(tmp / f"{path.stem}_hf", "moe" in path.name)
        else:
            mc["model_type"] = path.parent.name  # the family folder: qwen3, qwen3_moe
    out = tmp / path.name
    out.write_text(yaml.safe_dump(scaled))
    row["world"] = world
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            losses = run_local(_worker, world, (str(out),), timeout=240)[0]
    except Exception as e:  # noqa: BLE001 - the survey records every outcome
        text = str(e)
        last = [ln for ln in text.splitlines() if ln.strip()][-1] if text.strip() else type(e).__name__
        clear = any(k in last for k in ("ValueError", "ConfigError", "NotImplementedError"))
        return {**row, "status": "refused" if clear else "crash", "detail": last[:300]}
    ok = all(math.isfinite(x) for x in losses)
    return {**row, "status": "ok" if ok else "crash", "losses": losses}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="*", type=Path)
    ap.add_argument("--only", default="")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "configs_start.json")
    a = ap.parse_args(argv)
    import deepspeed  # noqa: F401  (imported once here: the forked ranks start in seconds)
    import transformers  # noqa: F401

    import msparallel_ds  # noqa: F401
    from msparallel_ds.runtime import disable_inference_shm_build, quiet_deepspeed

    quiet_deepspeed()
    disable_inference_shm_build()  # as msp.initialize does off CUDA: no JIT build of an inference-only op
    dirs = a.dirs or [*sorted(Path("/tmp").glob("mf-*/configs")), ROOT.parent / "shared" / "mindformers-configs"]
    paths = [p for p in training_yamls([d for d in dirs if d.is_dir()]) if a.only in str(p)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            try:
                row = try_one(path, Path(tmp))
            except Exception:  # noqa: BLE001 - a survey row, with the traceback's last line
                row = {"yaml": str(path), "name": path.name, "status": "crash",
                       "detail": traceback.format_exc().strip().splitlines()[-1][:300]}
            rows.append(row)
            print(f"{row['status']:8s} {row['name'][:60]:60s} {row.get('detail', row.get('losses', ''))}"[:220],
                  flush=True)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "refused", "crash", "flagship")}
    print(f"\n{len(rows)} training YAMLs: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"counts": counts, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
