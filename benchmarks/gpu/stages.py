"""Stage bookkeeping for benchmarks/gpu/run.sh (standard library only: it also runs before any wheel is installed).

    python stages.py write OUTDIR NAME --status S [--rc N --seconds T --timeout T]   # OUTDIR/NAME.json
    python stages.py summary OUTDIR                                                  # OUTDIR/summary.json + table

A stage's JSON: {"stage", "status" ("ok", "failed (rc=N)", "timeout after T s", "skipped: <why>"), "rc",
"seconds", "timeout_s", "log", "results"}. "results" embeds what the stage itself wrote: OUTDIR/NAME.result.json
(parsed) and, for the test stage, the counts and first failures of OUTDIR/NAME*.junit.xml.
"""
from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# Every stage run.sh writes, in its order (tests/test_gpu_run.py checks each one's JSON).
STAGES = ("0_install_wheels", "1_env", "2_build_ops", "3_gpu_tests", "4a_ring_step_kernels", "4b_ring_efficiency",
          "4c_ring_error", "5_train_step")


def junit_summary(paths: list[Path]) -> dict:
    out = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "time_s": 0.0, "first_failures": [],
           "files": [p.name for p in paths]}
    for p in paths:
        try:
            root = ET.parse(p).getroot()
        except (ET.ParseError, OSError) as exc:
            out["first_failures"].append(f"{p.name}: unreadable ({exc})")
            continue
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        for s in suites:
            for key in ("tests", "failures", "errors", "skipped"):
                out[key] += int(s.get(key, 0))
            out["time_s"] += float(s.get("time", 0.0))
            for case in s.iter("testcase"):
                for bad in (*case.findall("failure"), *case.findall("error")):
                    if len(out["first_failures"]) < 5:
                        name = f"{case.get('classname')}::{case.get('name')}"
                        out["first_failures"].append(f"{name}: {(bad.get('message') or '')[:400]}")
    out["passed"] = out["tests"] - out["failures"] - out["errors"] - out["skipped"]
    return out


def results_of(outdir: Path, name: str) -> dict:
    res = {}
    rj = outdir / f"{name}.result.json"
    if rj.is_file():
        try:
            res["data"] = json.loads(rj.read_text())
        except json.JSONDecodeError as exc:
            res["data_error"] = f"{rj.name}: {exc}"
    junits = sorted(outdir.glob(f"{name}*.junit.xml"))
    if junits:
        res["junit"] = junit_summary(junits)
    return res


def write(args) -> int:
    outdir = Path(args.outdir)
    doc = {"stage": args.name, "status": args.status, "rc": args.rc, "seconds": args.seconds,
           "timeout_s": args.timeout, "log": f"{args.name}.log", "results": results_of(outdir, args.name)}
    (outdir / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    return 0


def _headline(doc: dict) -> str:
    """One line of what a stage found, for the table run.sh prints last."""
    res = doc.get("results", {})
    data = res.get("data") or {}
    if "junit" in res:
        j = res["junit"]
        line = f"{j['passed']} passed, {j['failures']} failed, {j['errors']} errors, {j['skipped']} skipped"
        return line + (f"; first: {j['first_failures'][0][:150]}" if j["first_failures"] else "")
    if doc["stage"] == "1_env" and data:
        return (f"{data.get('gpu_name')} sm_{data.get('ops_arch')} torch {data.get('torch')} cuda "
                f"{data.get('torch_cuda')} driver {data.get('driver')} nvcc {data.get('nvcc')}")
    if "ceilings" in data:
        c = data["ceilings"]
        parts = [f"copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, mm {c['bf16_matmul_flop_per_s'] / 1e12:.0f} TF/s"]
        if data.get("step_kernel"):
            rows = data["step_kernel"]
            parts.append(f"fwd ratio {min(r['fwd_ratio'] for r in rows):.2f}-{max(r['fwd_ratio'] for r in rows):.2f}"
                         f", bwd {min(r['bwd_ratio'] for r in rows):.2f}-{max(r['bwd_ratio'] for r in rows):.2f}")
        if data.get("ring_efficiency"):
            parts.append("eff_max f+b " + " ".join(f"S{r['S'] // 1024}k/N{r['N']}={r['eff_max_fwd_bwd']:.2f}"
                                                  for r in data["ring_efficiency"]))
        if data.get("ring_error"):
            e = {r["N"]: r["fused_out_bf16"] for r in data["ring_error"]}
            parts.append(f"out err N1 {e.get(1, float('nan')):.1e} N8 {e.get(8, float('nan')):.1e}")
        return "; ".join(parts)
    if "variants" in data:
        bits = []
        for n, v in data["variants"].items():
            bits.append(f"{n} {v['tokens_per_s']:.0f} tok/s" + (f" mfu {v['mfu']:.2f}" if v.get("mfu") else "")
                        if v.get("status") == "ok" else f"{n} {v.get('status', '?')[:60]}")
        return "; ".join(bits)
    return ""


def summary(args) -> int:
    outdir = Path(args.outdir)
    docs = {}
    for name in STAGES:
        p = outdir / f"{name}.json"
        docs[name] = json.loads(p.read_text()) if p.is_file() else {"stage": name, "status": "missing (not run)"}
    (outdir / "summary.json").write_text(json.dumps(docs, indent=1))
    print(f"\n{'stage':<22} {'status':<24} {'s':>5}  found")
    for name, d in docs.items():
        secs = d.get("seconds")
        status = d["status"].split(" (torch.cuda")[0]
        print(f"{name:<22} {status[:24]:<24} {secs if secs is not None else '-':>5}  {_headline(d)[:300]}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("outdir")
    w.add_argument("name", choices=STAGES)
    w.add_argument("--status", required=True)
    w.add_argument("--rc", type=int, default=None)
    w.add_argument("--seconds", type=float, default=None)
    w.add_argument("--timeout", type=float, default=None)
    s = sub.add_parser("summary")
    s.add_argument("outdir")
    args = ap.parse_args(argv)
    try:
        return write(args) if args.cmd == "write" else summary(args)
    except Exception as exc:  # noqa: BLE001  (bookkeeping must never stop the run)
        print(f"stages.py {args.cmd}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
