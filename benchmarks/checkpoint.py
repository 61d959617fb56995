"""engine.save's cost per rank, old path (one msp_universal.pt on global rank 0) against the sharded path
(torch.distributed.checkpoint, every rank its chunks) and the async sharded save, same model, same layout.

A Llama of about 20M parameters (hidden 512, 6 layers, ffn 1408, 8 heads / 4 kv heads, vocab 4096; `--size 200m`:
hidden 1024, 12 layers, ffn 2816, vocab 16384) trains 2 AdamW steps (so the Adam moments exist) on 4 gloo CPU
processes, then saves. Measured per rank: the growth of resident memory during the save (peak VmHWM after
resetting it through /proc/self/clear_refs, minus VmRSS before the save) over the whole training state (fp32
weights + both Adam moments of every parameter), the bytes written, the largest file, the save wall time. Each
(layout, path) runs in fresh processes, so one path's freed memory cannot hide the other's. Async: the time until
engine.save returns plus the wait at the end, against the sync sharded save's time; the share hidden behind
`--steps` training steps is 1 - exposed / sync. Its growth column is until engine.save returns (the staged state);
the row also holds the growth over save + steps + wait and over the same steps without a save. The sharded and
async rows then save once more in the same processes (save2_s, exposed2_s, hidden_share_second: a run's later
saves, without the first save's one-time setup of its gloo groups). Replicas
(engine.save(dir, replicas=1), checkpoint.replicas): its disk and save time over the sharded save's.

    python benchmarks/checkpoint.py                     # writes results/checkpoint_cpu_20m.json and prints the table
    python benchmarks/checkpoint.py --modes sharded,replicas --out benchmarks/results/checkpoint_cpu_20m_replicas.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _ranks import run_ranks  # noqa: E402

SIZES = {"20m": dict(hidden=512, layers=6, ffn=1408, vocab=4096), "200m": dict(hidden=1024, layers=12, ffn=2816,
                                                                            vocab=16384)}
LAYOUTS = {"dp2_tp2_sp": dict(dp=2, tp=2, sp=True, pp=1), "pp2_dp2": dict(dp=2, tp=1, sp=False, pp=2)}
SEQ, ROWS = 64, 4
MIB = float(1 << 20)


def _yaml(size: dict, lay: dict) -> dict:
    par = {"data_parallel": lay["dp"], "model_parallel": lay["tp"], "pipeline_stage": lay["pp"],
           "use_seq_parallel": lay["sp"], "micro_batch_num": 2 if lay["pp"] > 1 else 1}
    doc = {"parallel_config": par,
           "parallel": {"enable_parallel_optimizer": True, "parallel_optimizer_config": {"optimizer_level": "level1"}},
           "runner_config": {"batch_size": ROWS // lay["dp"] // par["micro_batch_num"]},
           "optimizer": {"type": "AdamW", "learning_rate": 1e-3},
           "model": {"model_config": {"num_layers": size["layers"], "num_heads": 8, "n_kv_heads": 4,
                                      "hidden_size": size["hidden"], "seq_length": SEQ, "vocab_size": size["vocab"],
                                      "compute_dtype": "float32", "param_init_type": "float32"}}}
    if lay["pp"] > 1:
        doc["parallel"]["pipeline_config"] = {"pipeline_interleave": False, "pipeline_scheduler": "1f1b"}
    return doc


def _model(size: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"],
                                        intermediate_size=size["ffn"], num_hidden_layers=size["layers"],
                                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
                                        tie_word_embeddings=False)).float()


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _step(engine, step, vocab):
    import torch

    lay = engine.layout
    rows = ROWS // lay.size("dp")
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (ROWS, SEQ), generator=g)[lay.rank("dp") * rows:(lay.rank("dp") + 1) * rows]
    return engine.train_batch({"input_ids": ids, "labels": ids}).item()


def bench(rank, world, size_name, layout_name, mode, folder, steps):
    import torch
    import torch.distributed as dist

    import msparallel_ds as msp
    from msparallel_ds.checkpoint.sharded import wait_pending

    torch.set_num_threads(1)
    size = SIZES[size_name]
    with torch.device("meta"):
        state_bytes = 3 * 4 * sum(p.numel() for p in _model(size).parameters())  # fp32 + 2 Adam moments
    engine = msp.initialize(lambda: _model(size), msp.load_config(_yaml(size, LAYOUTS[layout_name])),
                            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    for s in range(2):
        _step(engine, s, size["vocab"])
    dist.barrier()
    out = {"rank": rank}
    if mode == "async":  # steps without a save in flight: their time and memory, against the same with one
        base = _rss("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        t = time.perf_counter()
        for s in range(steps):
            _step(engine, 10 + s, size["vocab"])
        out["steps_alone_s"] = time.perf_counter() - t
        out["steps_alone_growth_bytes"] = _rss("VmHWM") - base
        dist.barrier()
    base = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    t = time.perf_counter()
    if mode == "old":
        engine.save(folder, sharded=False)
    else:
        engine.save(folder, sharded=True, async_save=mode == "async", replicas=int(mode == "replicas"))
    out["save_s"] = time.perf_counter() - t
    if mode == "async":
        out["staged_growth_bytes"] = _rss("VmHWM") - base
        t = time.perf_counter()
        for s in range(steps):
            _step(engine, 20 + s, size["vocab"])
        out["steps_during_s"] = time.perf_counter() - t
        t = time.perf_counter()
        wait_pending()
        out["wait_s"] = time.perf_counter() - t
    out["growth_bytes"] = _rss("VmHWM") - base
    out["state_bytes"] = state_bytes
    dist.barrier()
    if mode in ("sharded", "async"):  # a second save in the same processes: no first-use setup (groups, imports)
        t = time.perf_counter()
        engine.save(folder, sharded=True, async_save=mode == "async")
        out["save2_s"] = time.perf_counter() - t
        if mode == "async":
            for s in range(steps):
                _step(engine, 30 + s, size["vocab"])
            t = time.perf_counter()
            wait_pending()
            out["wait2_s"] = time.perf_counter() - t
        dist.barrier()
    return out


def _files(folder: str) -> list[int]:
    return [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs]


MODES = ("old", "sharded", "async", "replicas")


def run(size: str, steps: int, modes=MODES) -> list[dict]:
    rows = []
    for layout in LAYOUTS:
        sync_s = sync_mib = sync2_s = None
        for mode in modes:
            folder = tempfile.mkdtemp(prefix=f"msp-ckpt-bench-{layout}-{mode}-")
            load = os.getloadavg()[0]  # the machine is shared: the 1-minute load average when the row started
            results, err, wall = run_ranks(bench, 4, (size, layout, mode, folder, steps), timeout=900,
                                           name="ckpt")
            if err:
                rows.append({"layout": layout, "mode": mode, **err})
                shutil.rmtree(folder, ignore_errors=True)
                continue
            sizes = _files(folder)
            state = results[0]["state_bytes"]
            growth = "staged_growth_bytes" if mode == "async" else "growth_bytes"  # async: until save returns
            row = {"size": size, "layout": layout, "mode": mode, "load_avg_1m": load, "state_mib": state / MIB,
                   "growth_over_state": [r[growth] / state for r in results],
                   "written_mib": sum(sizes) / MIB, "files": len(sizes), "largest_file_over_state": max(sizes) / state,
                   "save_s": max(r["save_s"] for r in results)}
            if mode in ("sharded", "async"):
                row["save2_s"] = max(r["save2_s"] for r in results)
            if mode == "sharded":
                sync_s, sync_mib, sync2_s = row["save_s"], row["written_mib"], row["save2_s"]
            if mode == "replicas" and sync_s:  # the cost of the data-parallel copies, against the plain sharded save
                row.update(disk_over_sharded=row["written_mib"] / sync_mib, time_over_sharded=row["save_s"] / sync_s)
            if mode == "async":
                exposed = max(r["save_s"] + r["wait_s"] for r in results)
                exposed2 = max(r["save2_s"] + r["wait2_s"] for r in results)
                row.update(exposed2_s=exposed2, hidden_share_second=(1 - exposed2 / sync2_s) if sync_s else None)
                row.update(exposed_s=exposed, hidden_share=(1 - exposed / sync_s) if sync_s else None,
                           steps=steps, steps_alone_s=max(r["steps_alone_s"] for r in results),
                           steps_during_s=max(r["steps_during_s"] for r in results),
                           window_growth_over_state=[r["growth_bytes"] / state for r in results],
                           steps_alone_growth_over_state=[r["steps_alone_growth_bytes"] / state for r in results])
            rows.append(row)
            shutil.rmtree(folder, ignore_errors=True)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="20m")
    ap.add_argument("--steps", type=int, default=4, help="training steps run while an async save writes")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = run(args.size, args.steps, tuple(args.modes.split(",")))
    print(f"\n{'layout':12} {'mode':8} {'state MiB':>9} {'growth/state per rank':>30} {'written MiB':>11} "
          f"{'largest/state':>13} {'save s':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['layout']:12} {r['mode']:8} error: {r['error']}")
            continue
        growth = " ".join(f"{g:.2f}" for g in r["growth_over_state"])
        print(f"{r['layout']:12} {r['mode']:8} {r['state_mib']:9.1f} {growth:>30} {r['written_mib']:11.1f} "
              f"{r['largest_file_over_state']:13.2f} {r['save_s']:7.2f}"
              + (f"  exposed {r['exposed_s']:.2f} s, hidden {r['hidden_share']:.2f}; second save: exposed "
                 f"{r['exposed2_s']:.2f} s, hidden {r['hidden_share_second']:.2f}" if "exposed_s" in r else "")
              + (f"  disk x{r['disk_over_sharded']:.2f}, time x{r['time_over_sharded']:.2f} of sharded"
                 if "disk_over_sharded" in r else ""))
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"checkpoint_cpu_{args.size}.json"
    out.write_text(json.dumps({"host": platform.node(), "cpus": os.cpu_count(), "size": args.size, "rows": rows},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
