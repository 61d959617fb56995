"""Expert-parallel training: msparallel_ds ep1/ep2/ep4 against DeepSpeed AutoEP and transformers' own EP.

A tiny Qwen3-MoE (from Qwen3MoeConfig; 8 experts top-2 in every layer, no aux loss, router init std --router-std)
trains on N gloo processes: same initial weights, same fixed global batch, same AdamW, no clipping, in every variant.
  msp_ep1/2/4  msp.initialize, data_parallel=N, parallel_config.expert_parallel 1/2/4, ZeRO-2 (optimizer_level
               level2); msp_ep1 (experts replicated) is the baseline of every ratio, in the same run.
  ds_autoep2/4 DeepSpeed AutoEP ("expert_parallel": {"enabled": true, "autoep_size": ep, "preset_model": "qwen3_moe"}),
               tp 1, the ZeRO-2 section msp_ep1's YAML maps to, DeepSpeed's MoE param groups (its ZeRO-1/2 asserts
               them). Stock 0.19.8 fails with transformers 5.23 in deepspeed.initialize (it calls the output-capture
               registry's get(key, default), which 5.23 does not take); unless --no-autoep-shim the ranks give that
               registry a two-argument get. The JSON records the stock error.
  hf_ep4       from_pretrained(dir, distributed_config=DistributedConfig(fsdp_size=N, ep_size=ep)): the model's
               base_model_ep_plan with AllToAllEP; ep must divide fsdp*tp, so dense weights are FSDP2 (ZeRO-3-like).
Process groups forked after the heavy imports, --repeats rotated repeats, medians (as train.py). All-to-all bytes
per rank and step sent off-rank, fwd + bwd, float payload: measured by distributed.instruments.comm_stats (msp) or
a counter around torch.distributed / transformers' all-to-alls (peers, msp cross-check); exact = 4 (dispatch,
combine; fwd, bwd) x rows routed to other ranks' experts (pre-hook on the experts) x hidden x 4 B; uniform = 4 x
layers x local tokens x top_k x (ep-1)/ep x hidden x 4 B. Memory: peak RSS delta over the RSS after the model is
built (hf: after from_pretrained, which shards it); expert parameter bytes held per rank.

    python benchmarks/moe.py                      # 4 CPU processes, 3 repeats, writes results/moe_cpu.json
    python benchmarks/moe.py --variants msp_ep1 msp_ep4 --repeats 1 --steps 4
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _ranks import run_ranks  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)

VARIANTS = ("msp_ep1", "msp_ep2", "msp_ep4", "ds_autoep2", "ds_autoep4", "hf_ep4")
BASELINE = "msp_ep1"
PRELOAD = ("deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.moe.utils",
           "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.module_inject.auto_ep", "transformers",
           "deepspeed.module_inject.auto_ep_layer", "transformers.models.qwen3_moe.modeling_qwen3_moe",
           "transformers.distributed.expert_parallel", "transformers.distributed.fsdp", "msparallel_ds.engine",
           "msparallel_ds.moe.dispatch")


def _ep(name: str) -> int:
    return int(name.rsplit("ep", 1)[1])


def _yaml(args: dict, ep: int) -> dict:
    """The MindFormers YAML (as a dict) of an msp variant: ZeRO-2, no clipping, micro batch = global / dp."""
    w, mc = args["world"], {"num_layers": args["layers"], "num_heads": 4, "n_kv_heads": 2, "seq_length": args["seq"],
                            "hidden_size": args["hidden"], "vocab_size": args["vocab"], "compute_dtype": "float32"}
    return {"parallel_config": {"data_parallel": w, "model_parallel": 1, "context_parallel": 1, "pipeline_stage": 1,
                                "expert_parallel": ep, "vocab_emb_dp": True, "micro_batch_num": 1},
            "parallel": {"enable_parallel_optimizer": True, "parallel_optimizer_config": {"optimizer_level": "level2"}},
            "runner_config": {"batch_size": args["global_batch"] // w, "gradient_accumulation_steps": 1},
            "runner_wrapper": {"use_clip_grad": False}, "model": {"model_config": {**mc, "param_init_type": "float32"}}}


def _model(args: dict):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)  # identical initial weights in every variant and on every rank
    cfg = Qwen3MoeConfig(vocab_size=args["vocab"], hidden_size=args["hidden"], intermediate_size=2 * args["hidden"],
                         moe_intermediate_size=args["moe_ffn"], num_hidden_layers=args["layers"], num_attention_heads=4,
                         num_key_value_heads=2, head_dim=args["hidden"] // 4, num_experts=args["experts"],
                         num_experts_per_tok=args["top_k"], max_position_embeddings=args["seq"],
                         attention_dropout=0.0, attn_implementation="sdpa")
    m = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():
        for p in (p for n, p in m.named_parameters() if n.endswith("mlp.gate.weight")):  # the routers
            p.normal_(0, args["router_std"])
    return m


def _count_a2a(wire: dict) -> None:
    """Count the bytes each all-to-all sends to other ranks (float payload: tokens, int: counts) in this process."""
    import torch.distributed as dist
    import transformers.distributed.expert_parallel as hfep

    def add(t, splits, group):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        rows = t.shape[0]
        splits = list(splits) if splits else [rows // n] * n
        off = (rows - splits[r]) * (t.numel() // max(rows, 1)) * t.element_size()
        wire["tokens" if t.is_floating_point() else "counts"] += off

    orig, hf_auto = dist.all_to_all_single, hfep.all_to_all_single_autograd  # hfep's all_to_all_single is orig

    def single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        add(input, input_split_sizes, group)
        return orig(output, input, output_split_sizes, input_split_sizes, group, async_op)

    def hf_auto_counted(x, out_sizes, in_sizes, group):
        add(x, in_sizes, group)
        y = hf_auto(x, out_sizes, in_sizes, group)
        if y.requires_grad:  # its backward sends the output's gradient rows back along out_sizes
            y.register_hook(lambda g: add(g, out_sizes, group))
        return y

    dist.all_to_all_single, hfep.all_to_all_single, hfep.all_to_all_single_autograd = (
        single, single, hf_auto_counted)


def _engine(name: str, model, args: dict, rank: int):
    import torch
    import torch.distributed as dist

    lr, rows = args["lr"], args["global_batch"] // args["world"]
    sl = slice(rank * rows, (rank + 1) * rows)
    if name.startswith("msp"):
        import msparallel_ds as msp
        from msparallel_ds.moe.dispatch import ExpertParallelExperts

        eng = msp.initialize(model, _yaml(args, _ep(name)), optimizer=lambda p: torch.optim.AdamW(p, lr=lr))
        d, r = eng.layout.rank("dp"), eng.micro_batch_size * eng.gradient_accumulation_steps
        assert r == rows and eng.layout.size("dp") == args["world"], "global batch does not split over dp"
        experts = [m for m in eng.model.modules() if isinstance(m, ExpertParallelExperts)]
        step = (lambda ids: eng.train_batch({"input_ids": ids[d * r:(d + 1) * r], "labels": ids[d * r:(d + 1) * r]}))
        return step, (lambda loss: loss.item()), eng.model, experts, (eng.layout.rank("ep") if experts else 0)
    if name.startswith("ds"):
        import deepspeed
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as moe_groups

        cfg = {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1,
               "train_batch_size": args["global_batch"], "zero_optimization": dict(args["zero"]),
               "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 2**30,
               "expert_parallel": {"enabled": True, "autoep_size": _ep(name), "preset_model": "qwen3_moe"}}

        def opt(params):  # DeepSpeed's ZeRO-1/2 requires its MoE param groups when the model has MoE layers
            return torch.optim.AdamW(moe_groups({"params": list(params), "name": "all"}), lr=lr)

        eng, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, dist_init_required=False)
        fwd, bwd, upd, module, experts, ep_rank = eng, eng.backward, eng.step, eng.module, [], 0
    else:  # hf: the model came from from_pretrained(distributed_config); expert mesh (efsdp, ep), ep innermost
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        fwd, bwd, upd, module = model, (lambda loss: loss.backward()), (lambda: (opt.step(), opt.zero_grad())), model
        experts, ep_rank = [layer.mlp.experts for layer in model.model.layers], dist.get_rank() % _ep(name)

    def step(ids):
        loss = fwd(input_ids=ids[sl], labels=ids[sl]).loss
        bwd(loss)
        upd()
        return loss.detach()

    def mean_loss(loss):  # every rank holds the same number of tokens
        loss = loss.float().clone()
        dist.all_reduce(loss)
        return loss.item() / dist.get_world_size()

    return step, mean_loss, module, experts, ep_rank


def _rank_main(rank: int, world: int, name: str, args: dict) -> dict:
    """One rank of variant `name` (run by _ranks.run_ranks, which sets the env, reports and cleans up)."""
    import logging
    import warnings

    import deepspeed.ops
    import torch
    import torch.distributed as dist
    import transformers
    from deepspeed.utils import logger as ds_logger

    from msparallel_ds.distributed import instruments

    ds_logger.setLevel(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args["threads"])
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # inference-only op, a minute of compiling
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args["timeout"]))
    if name.startswith("ds") and args["autoep_shim"]:  # AutoEP calls get(str_key, default); 5.23 takes a model
        from transformers.utils.output_capturing import _CanRecordRegistry as reg

        reg.get = lambda self, key, default=None: dict.get(self, key if isinstance(key, str) else str(type(key)),
                                                           default)
    ids = torch.randint(0, args["vocab"], (args["global_batch"], args["seq"]),
                        generator=torch.Generator().manual_seed(1234))  # one fixed global batch, every step
    if name.startswith("hf"):
        hf_cfg = transformers.distributed.DistributedConfig(fsdp_size=world, ep_size=_ep(name))
        model = transformers.Qwen3MoeForCausalLM.from_pretrained(args["ckpt"], dtype=torch.float32,
                                                                 distributed_config=hf_cfg)
    else:
        model = _model(args)
    base = next(int(ln.split()[1]) / 1024 for ln in Path("/proc/self/status").read_text().splitlines()
                if ln.startswith("VmRSS:"))  # MiB resident after the model is built
    step, global_loss, module, experts, ep_rank = _engine(name, model, args, rank)
    wire, e_all = {"tokens": 0, "counts": 0, "off_rank_rows": 0}, args["experts"]
    _count_a2a(wire)

    def route_hook(module, a, kw):  # the (token, choice) pairs whose expert lives on another ep rank
        idx = a[1] if len(a) > 1 else kw["top_k_index"]
        wire["off_rank_rows"] += int((idx[idx < e_all] // (e_all // _ep(name)) != ep_rank).sum())

    for m in experts:
        m.register_forward_pre_hook(route_hook, with_kwargs=True)
    rec = {k: [] for k in ("times_s", "cpu_s", "losses", "instr_bytes", "wire_bytes", "count_bytes", "exact_bytes")}
    for i in range(args["warmup"] + args["steps"]):
        wire.update(dict.fromkeys(wire, 0))
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        with instruments.comm_stats() as st:
            loss = step(ids)
        t, c = time.perf_counter() - t0, time.process_time() - c0
        rec["losses"].append(global_loss(loss))
        if i >= args["warmup"]:
            for k, v in (("times_s", t), ("cpu_s", c), ("instr_bytes", st["bus_bytes"]),
                         ("wire_bytes", wire["tokens"]), ("count_bytes", wire["counts"]),
                         ("exact_bytes", 4 * wire["off_rank_rows"] * args["hidden"] * 4)):
                rec[k].append(v)
    ex = [p.to_local() if hasattr(p, "to_local") else p for n, p in module.named_parameters() if "expert" in n]
    rec.update(peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, base_mib=base,
               expert_mib=sum(p.numel() * p.element_size() for p in ex) / 2**20, has_route_hook=bool(experts))
    return rec

def _run_group(name: str, args: dict) -> dict:
    """One variant on `world` forked processes; per-step results, or {"error": last line, "traceback": ...}."""
    world = args["world"]
    rk, failed, wall = run_ranks(_rank_main, world, (name, args), timeout=args["timeout"], name=name)
    if failed:
        return failed
    steps, tokens = range(args["steps"]), args["global_batch"] * args["seq"]
    step_t = [max(r["times_s"][i] for r in rk) for i in steps]  # the slowest rank's
    per_rank_step = lambda key: sum(sum(r[key]) for r in rk) / (world * args["steps"])  # noqa: E731  bytes, mean
    return {"step_times_s": step_t, "tokens_per_s": tokens / statistics.median(step_t),
            "tokens_per_cpu_s": tokens / statistics.median(sum(r["cpu_s"][i] for r in rk) for i in steps),
            "peak_mib_per_rank": [r["peak_mib"] for r in rk], "base_mib_per_rank": [r["base_mib"] for r in rk],
            "delta_mib": max(r["peak_mib"] - r["base_mib"] for r in rk), "expert_mib": max(r["expert_mib"] for r in rk),
            "a2a_instr_bytes": per_rank_step("instr_bytes"), "a2a_wire_bytes": per_rank_step("wire_bytes"),
            "a2a_count_bytes": per_rank_step("count_bytes"),
            "a2a_exact_bytes": per_rank_step("exact_bytes") if rk[0]["has_route_hook"] else None,
            "losses": rk[0]["losses"], "final_loss": rk[0]["losses"][-1], "wall_s": wall}


def _summarise(name: str, runs: list, base_runs: list, args: dict) -> dict:
    ep = _ep(name)
    uniform = 4 * args["layers"] * args["global_batch"] * args["seq"] / args["world"] * args["top_k"] * (ep - 1) / ep
    lay = {"msp": "dp{} x ep{}", "ds_": "dp{} x ep{} tp1", "hf_": "fsdp{} x ep{}"}[name[:3]].format(args["world"], ep)
    row = {"variant": name, "layout": lay, "a2a_uniform_mb": uniform * args["hidden"] * 4 / 1e6}
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {**row, "error": runs[0]["error"]}
    pairs = [(r, b) for r, b in zip(runs, base_runs) if "error" not in r and "error" not in b]
    med = lambda key: statistics.median(r[key] for r in ok)  # noqa: E731
    measured = med("a2a_instr_bytes") if name.startswith("msp") else med("a2a_wire_bytes")
    exact = med("a2a_exact_bytes") if ok[0]["a2a_exact_bytes"] is not None else None
    return {**row, "tokens_per_s": med("tokens_per_s"), "tokens_per_cpu_s": med("tokens_per_cpu_s"),
            "ratios_per_repeat": (rr := [r["tokens_per_s"] / b["tokens_per_s"] for r, b in pairs]),
            "ratio_vs_baseline": statistics.median(rr) if pairs else None, "cpu_ratio_vs_baseline": statistics.median(
                r["tokens_per_cpu_s"] / b["tokens_per_cpu_s"] for r, b in pairs) if pairs else None,
            "delta_mib_per_rank": med("delta_mib"), "expert_mib_per_rank": med("expert_mib"),
            "peak_mib_per_rank": statistics.median(max(r["peak_mib_per_rank"]) for r in ok),
            "a2a_measured_mb": measured / 1e6, "a2a_exact_mb": exact / 1e6 if exact is not None else None,
            "a2a_measured_source": "instruments.comm_stats" if name.startswith("msp") else "all_to_all wrapper",
            "a2a_wire_mb": med("a2a_wire_bytes") / 1e6, "a2a_count_exchange_mb": med("a2a_count_bytes") / 1e6,
            "measured_over_exact": measured / exact if exact else None,
            "measured_over_uniform": measured / (row["a2a_uniform_mb"] * 1e6) if ep > 1 else None,
            "final_loss": ok[-1]["final_loss"], "losses": ok[-1]["losses"],
            "max_rel_loss_diff_vs_baseline": max(max(abs(x - y) / abs(y) for x, y in zip(r["losses"], b["losses"]))
                                                 for r, b in pairs) if pairs else None,
            "failed_repeats": len(runs) - len(ok)}


COLS = (("tok/s", "tokens_per_s", "6.0f"), ("x " + BASELINE, "ratio_vs_baseline", "9.3f"),
        ("x CPU", "cpu_ratio_vs_baseline", "5.2f"), ("RSS d MiB", "delta_mib_per_rank", "9.0f"),
        ("exp MiB", "expert_mib_per_rank", "7.2f"), ("a2a MB", "a2a_measured_mb", "7.3f"), ("exact MB", "a2a_exact_mb",
        "8.3f"), ("/exact", "measured_over_exact", "6.3f"), ("unif MB", "a2a_uniform_mb", "7.3f"),
        ("/unif", "measured_over_uniform", "5.2f"), ("final loss", "final_loss", "10.6f"))


def _print(rows: list, args: dict) -> None:
    cell = lambda x, spec: format(x, spec) if x is not None else format("-", ">" + spec.split(".")[0])  # noqa: E731
    head = f"{'variant':<10} {'layout':<13} " + " ".join(f"{h:>{spec.split('.')[0]}}" for h, _, spec in COLS)
    print(head + "\n" + "-" * len(head))
    for r in rows:
        body = f"did not run: {r['error'][:90]}" if "error" in r else " ".join(cell(r[k], sp) for _, k, sp in COLS)
        print(f"{r['variant']:<10} {r['layout']:<13} {body}")
    print(f"tok/s: global tokens / median step time (slowest rank), median of {args['repeats']} rotated repeats; x "
          f"{BASELINE}: median per-\nrepeat ratio; x CPU: the same for tokens per CPU-second of all ranks (less "
          "sensitive to other load).\nRSS d: peak RSS - RSS after model build; exp MiB: expert params per rank; a2a "
          "MB: bytes per rank and step sent\noff-rank (fwd+bwd); exact: from the routing seen; unif: for uniform "
          "routing.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--world", type=int, default=4, help="processes per variant")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    for k, v in (("hidden", 128), ("layers", 4), ("experts", 8), ("top-k", 2), ("moe-ffn", 128), ("vocab", 1024),
                 ("seq", 128), ("global-batch", 8), ("warmup", 2), ("steps", 20), ("repeats", 3)):
        ap.add_argument(f"--{k}", type=int, default=v)
    for k, v in (("router-std", 0.5), ("lr", 1e-3), ("loss-rtol", 1e-5), ("timeout", 240.0)):
        ap.add_argument(f"--{k}", type=float, default=v)  # loss-rtol: msp variants' losses must agree; timeout: s/group
    ap.add_argument("--no-autoep-shim", dest="autoep_shim", action="store_false",
                    help="run DeepSpeed AutoEP without the transformers-registry compatibility shim")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "moe_cpu.json"))
    a = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    args = {k: v for k, v in vars(a).items() if k not in ("variants", "json")}
    bad = [n for n in a.variants if a.experts % _ep(n) or a.world % _ep(n)]
    if a.global_batch % a.world or bad:
        ap.error(f"--global-batch must split over --world, and ep must divide --experts and --world: {bad}")
    import torch

    torch.set_num_threads(1)  # no parallel region before forking
    for mod in PRELOAD:
        importlib.import_module(mod)
    import deepspeed
    import transformers

    import msparallel_ds as msp
    from transformers.utils import output_capturing as oc

    transformers.utils.logging.disable_progress_bar()
    try:  # the exact error stock DeepSpeed AutoEP hits in this environment, if any
        oc._CanRecordRegistry().get("k", None)
        stock = None
    except TypeError as e:
        stock = f"{type(e).__name__}: {e}"
    plan = msp.make_plan(msp.load_config(_yaml(args, 1)), world_size=a.world)
    args["zero"] = plan.to_deepspeed()["zero_optimization"]  # ds_autoep: the ZeRO section msp_ep1's YAML maps to
    args["ckpt"] = tempfile.mkdtemp(prefix="msp_moe_")
    _model(args).save_pretrained(args["ckpt"])  # hf_ep4 loads the same initial weights through from_pretrained
    names = list(dict.fromkeys([BASELINE] + a.variants))
    raw = {n: [] for n in names}
    t0, load0 = time.monotonic(), os.getloadavg()
    try:
        for rep in range(a.repeats):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                res = _run_group(name, args)
                raw[name].append({"repeat": rep, **res})
                status = f"{res['tokens_per_s']:.0f} tokens/s" if "error" not in res else f"failed: {res['error']}"
                print(f"[repeat {rep + 1}/{a.repeats}] {name:<10} {status} ({res['wall_s']:.1f} s)", flush=True)
    finally:
        shutil.rmtree(args["ckpt"], ignore_errors=True)
    rows = [_summarise(n, raw[n], raw[BASELINE], args) for n in names]  # raw lists are in repeat order
    print()
    _print(rows, args)
    msp_rows = [r for r in rows if r["variant"].startswith("msp") and "error" not in r and r["variant"] != BASELINE]
    diffs = [r["max_rel_loss_diff_vs_baseline"] for r in msp_rows]  # None: no baseline run to compare with
    worst = max((float("inf") if d is None else d for d in diffs), default=None)
    agree = worst <= a.loss_rtol if msp_rows else None
    if msp_rows:
        print(f"msp losses (every step) vs {BASELINE}: max relative difference {worst:.2e} -> "
              f"{'agree' if agree else 'DISAGREE'} (rtol {a.loss_rtol:g})")
        print("msp a2a MB/step, instruments vs all_to_all_single wrapper: " + ", ".join(
            f"{r['variant']} {r['a2a_measured_mb']:.6f} vs {r['a2a_wire_mb']:.6f}" for r in msp_rows))
    report = {"config": {k: v for k, v in args.items() if k != "ckpt"},
              "machine": {"cpu_count": os.cpu_count(), "affinity_cpus": len(os.sched_getaffinity(0)),
                          "platform": platform.platform(), "python": platform.python_version(),
                          "torch": torch.__version__, "deepspeed": deepspeed.__version__,
                          "transformers": transformers.__version__, "load_avg_at_start": load0,
                          "load_avg_at_end": os.getloadavg(), "total_wall_s": time.monotonic() - t0},
              "notes": {"ds_autoep_stock_error": stock, "ds_autoep_shim_applied": bool(a.autoep_shim and stock),
                        "ds_autoep_stock_error_site": "deepspeed.initialize > AutoEP.replace_moe_layers > auto_ep_"
                        "presets/base.py:326 _install_instance_transformers_output_recorders" if stock else None,
                        "msp_losses_agree": agree, "msp_max_rel_loss_diff": worst, "MB": 1e6, "doc": __doc__},
              "summary": rows, "raw": raw}
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    if stock and any(n.startswith("ds") for n in names):
        print(f"ds_autoep: stock DeepSpeed {deepspeed.__version__} + transformers {transformers.__version__} fails in "
              f"deepspeed.initialize:\n  {stock}\n  " + ("run here with a registry shim (--no-autoep-shim: stock)"
                                                        if a.autoep_shim else "run stock"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
