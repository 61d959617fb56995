"""msparallel-ds: plan, export and validate MindFormers parallel configs; `demo` trains one for real.

Exit codes: 0 success, 2 configuration error (message only), 1 internal error.
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Optional, Sequence

from .config.errors import ConfigError, ConfigWarning


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="msparallel-ds",
                                 description="Run MindFormers parallel strategies on PyTorch: plan, export, validate.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="show the plan (mesh, batch, ZeRO, schedule, memory) for a YAML")
    p.add_argument("file")
    p.add_argument("--world-size", type=int, default=None, help="number of processes (checked against the YAML)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--draw", metavar="DIR", default=None,
                   help="also write mesh.png, schedule.png and memory.png into DIR (needs matplotlib)")
    p.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                   help="device memory line on memory.png (default: the YAML's context.max_device_memory)")
    e = sub.add_parser("export", help="write a DeepSpeed config or an accelerate launch config")
    e.add_argument("file")
    e.add_argument("--to", choices=("deepspeed", "accelerate"), required=True)
    e.add_argument("--world-size", type=int, default=None)
    e.add_argument("-o", "--output", default=None, help="write here instead of stdout")
    d = sub.add_parser("demo", help="train a tiny Llama on several CPU processes under a MindFormers YAML and check "
                                     "the losses against one process")
    d.add_argument("--config", default=None, help="MindFormers YAML (default: the bundled dp2 x tp2+SP x cp2 demo)")
    d.add_argument("--nproc", type=int, default=None, help="processes (default: the YAML's world size)")
    d.add_argument("--steps", type=int, default=10)
    d.add_argument("--timeout", type=float, default=300, help="seconds before a stuck run is stopped")
    c = sub.add_parser("convert-checkpoint", help="slice an engine.save checkpoint for another YAML's layout, offline")
    c.add_argument("src", help="folder written by engine.save")
    c.add_argument("dst", help="new folder for the converted checkpoint")
    c.add_argument("--to-config", default=None, help="MindFormers YAML of the run that will load it")
    c.add_argument("--sharded", action="store_true", help="write the sharded format instead (engine.save(dir, "
                                                          "sharded=True); loads under any layout, no --to-config)")
    c.add_argument("--timeout", type=float, default=600)
    i = sub.add_parser("import-mindspore", help="MindSpore / MindFormers weights (.ckpt, .safetensors, per-rank "
                                                "slices) -> a HF folder, or an engine.load checkpoint for a layout")
    i.add_argument("src", help=".ckpt / .safetensors file, safetensors index, or a folder (rank_*/ slices)")
    i.add_argument("dst", help="new folder to write")
    i.add_argument("--config", required=True, help="the MindFormers YAML of the run that saved SRC (its model)")
    i.add_argument("--strategy", default=None, help="strategy file or folder of sliced SRC (default: found next "
                                                    "to the rank folders, MindFormers' output/strategy)")
    i.add_argument("--to-layout", default=None, help="write engine.load's checkpoint sliced for this YAML instead")
    i.add_argument("--legacy-fused-layout", choices=("interleaved", "concat"), default="interleaved",
                   help="legacy w_qkv / w_gate_hidden: interleaved (MindFormers >= 1.6, 2.x) or concat (1.3)")
    i.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="cast floating weights (default: keep the checkpoint's)")
    x = sub.add_parser("export-mindspore", help="a HF folder -> one merged MindSpore checkpoint, MindFormers names")
    x.add_argument("src", help="HF folder (config.json + safetensors)")
    x.add_argument("dst", help="new .ckpt or .safetensors file")
    x.add_argument("--config", required=True, help="the MindFormers YAML that will load it (legacy or mcore names)")
    x.add_argument("--format", choices=("ckpt", "safetensors"), default=None, help="default: from DST's suffix")
    x.add_argument("--legacy-fused-layout", choices=("interleaved", "concat"), default="interleaved")
    x.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None)
    v = sub.add_parser("validate", help="check one or more YAMLs; one line per file")
    v.add_argument("files", nargs="+")
    v.add_argument("--world-size", type=int, default=None)
    _suggest_parser(sub)
    from .run.launch import add_arguments
    add_arguments(sub.add_parser("train", help="run a MindFormers YAML's training (model, data, loop, checkpoints, "
                                               "resume) on PyTorch, under any launcher or on N local processes"))
    return ap


def _suggest_parser(sub) -> None:
    g = sub.add_parser("suggest", help="search the MindFormers layouts of a model for N devices: drop those over "
                                       "memory, rank the rest with a cost model, write the best as a YAML")
    g.add_argument("--model", required=True, help="HF config.json or a MindFormers YAML (its model.model_config)")
    g.add_argument("--world-size", type=int, default=None, help="devices (default: a YAML's own degrees' product)")
    g.add_argument("--device-memory", default="80GiB", help="per device, e.g. 80GiB, 64GB, 512MiB (default 80GiB)")
    g.add_argument("--headroom", type=float, default=0.9, help="share of the device memory the estimate may use")
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: the YAML's")
    g.add_argument("--intra-bw", type=float, default=200, help="GB/s inside a node (default 200, NVLink-class)")
    g.add_argument("--inter-bw", type=float, default=25, help="GB/s across nodes (default 25, IB-class)")
    g.add_argument("--devices-per-node", type=int, default=8)
    g.add_argument("--flops", type=float, default=400e12, help="dense matmul FLOP/s per device (default 400e12)")
    g.add_argument("--mfu", type=float, default=0.4, help="share of --flops a step achieves (default 0.4)")
    g.add_argument("--calibrate", action="store_true", help="measure FLOP/s and all-reduce bandwidth here first")
    g.add_argument("--top", type=int, default=10)
    g.add_argument("-o", "--output", default=None, help="write the best layout as a MindFormers YAML")
    g.add_argument("--format", choices=("table", "json"), default="table")


def _plan(path: str, world_size: Optional[int], device_memory_gib: Optional[float] = None, report: bool = False):
    from .plan import make_plan
    from .suggest.auto import load_config_auto

    # parallel_mode: 2 (auto_parallel): the strategy suggest chooses, with a warning saying which
    cfg = load_config_auto(Path(path), world_size=world_size,
                           device_memory_bytes=device_memory_gib * 2**30 if device_memory_gib else None)
    return make_plan(cfg, world_size=world_size, report=report)


def _cmd_plan(args) -> int:
    plan = _plan(args.file, args.world_size, args.device_memory, report=True)
    if args.format == "json":
        print(plan.to_json())
    else:
        from .checkpoint.save_plan import format_save_report, save_report

        print(plan.summary())
        print(format_save_report(plan, save_report(plan)))
    if args.draw is None:
        return 0
    from .draw import draw_plan, require_matplotlib
    from .draw.memory import device_memory_from_yaml

    try:
        require_matplotlib()
    except ImportError as exc:
        print(f"error: --draw: {exc}", file=sys.stderr)
        return 2
    device = args.device_memory if args.device_memory is not None else device_memory_from_yaml(args.file)
    try:
        paths = draw_plan(plan, args.draw, device_memory_gib=device)
    except OSError as exc:  # the user's folder: a message, not an internal error
        print(f"error: cannot write pictures into --draw {args.draw}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    out = sys.stderr if args.format == "json" else sys.stdout  # keep stdout valid JSON
    t = paths.schedule
    print(f"schedule {t.name}: bubble fraction {t.bubble:.6f} (makespan {t.makespan:g} units)", file=out)
    for kind, path in paths.items():
        print(f"wrote {kind}: {path}", file=out)
    return 0


def _cmd_export(args) -> int:
    plan = _plan(args.file, args.world_size)
    if args.to == "deepspeed":
        text = json.dumps(plan.to_deepspeed(), indent=2) + "\n"
    else:
        import yaml

        from .export.accelerate import header, pipeline_note

        if pipeline_note(plan):
            warnings.warn(pipeline_note(plan), ConfigWarning, stacklevel=1)
        text = header(plan, str(Path(args.file).resolve())) + yaml.safe_dump(plan.to_accelerate(), sort_keys=False)
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as exc:  # the user's path: a message and exit 2, not an internal error
            print(f"error: cannot write --output {args.output}: {exc.strerror or exc} (check that the folder "
                  f"{Path(args.output).parent} exists and is writable, or leave out -o to print to stdout)",
                  file=sys.stderr)
            return 2
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _cmd_demo(args) -> int:
    from .demo import run_demo

    problems = [f"--steps {args.steps} must be >= 1"] if args.steps < 1 else []
    if args.nproc is not None and args.nproc < 1:
        problems.append(f"--nproc {args.nproc} must be >= 1 (leave it out to use the YAML's world size)")
    if not _positive_seconds(args.timeout):
        problems.append(f"--timeout {args.timeout} must be a positive number of seconds (default 300)")
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    result = run_demo(args.config, args.nproc, args.steps, timeout=args.timeout,
                      echo=lambda line: print(line, flush=True))
    return 0 if result["finite"] else 1


def _positive_seconds(x: float) -> bool:
    return x > 0 and x != float("inf")  # NaN fails x > 0


def _cmd_convert(args) -> int:
    from .checkpoint.convert import convert_checkpoint

    if not _positive_seconds(args.timeout):
        print(f"error: --timeout {args.timeout} must be a positive number of seconds (default 600)", file=sys.stderr)
        return 2
    if bool(args.sharded) == bool(args.to_config):
        print("error: convert-checkpoint needs exactly one of --to-config NEW.yaml (pre-slice for that layout) or "
              "--sharded (the layout-independent sharded format)", file=sys.stderr)
        return 2
    if args.sharded:
        from .checkpoint.convert import convert_to_sharded

        try:
            man = convert_to_sharded(args.src, args.dst)
        except (OSError, ValueError, RuntimeError) as exc:
            return _user_error(exc)
        print(f"converted {args.src} -> {args.dst} (sharded, {len(man['checksums'])} chunks; loads under any layout)")
        return 0
    try:
        index = convert_checkpoint(args.src, args.dst, args.to_config, timeout=args.timeout,
                                   echo=lambda line: print(line, flush=True))
    except (OSError, ValueError, RuntimeError, TimeoutError) as exc:  # the user's paths or checkpoint: no traceback
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        print(f"error: {last}", file=sys.stderr)
        return 2
    print(f"converted {args.src} -> {args.dst} for pipeline_stage={index['mesh']['pp']}, "
          f"model_parallel={index['mesh']['tp']} ({len(index['files'])} files)")
    return 0


def _user_error(exc: BaseException) -> int:
    """The user's paths, checkpoint or YAML: the message, no traceback, exit 2."""
    text = str(exc).strip()
    print(f"error: {text or type(exc).__name__}", file=sys.stderr)
    return 2


def _cmd_import(args) -> int:
    from .checkpoint.mindformers import import_mindspore

    try:
        report = import_mindspore(args.src, args.dst, args.config, strategy=args.strategy, to_layout=args.to_layout,
                                  legacy_fused_layout=args.legacy_fused_layout, dtype=args.dtype,
                                  echo=lambda line: print(line, flush=True))
    except (OSError, ValueError, KeyError) as exc:
        return _user_error(exc)
    what = f"engine.load checkpoint for {args.to_layout}" if args.to_layout else "HF folder"
    print(f"imported {report['tensors']} tensors ({report['parameters']:,} parameters, "
          f"{'legacy' if report['legacy'] else 'mcore'} {report['model_type']}) from {len(report['files'])} file(s) "
          f"-> {what} {args.dst}; left out {len(report['dropped'])} non-weight entries (optimizer state, scalars)")
    return 0


def _cmd_export_ms(args) -> int:
    from .checkpoint.mindformers import export_mindspore

    fmt = args.format or ("safetensors" if args.dst.endswith(".safetensors") else "ckpt")
    try:
        report = export_mindspore(args.src, args.dst, args.config, fmt=fmt, dtype=args.dtype,
                                  legacy_fused_layout=args.legacy_fused_layout)
    except (OSError, ValueError, KeyError) as exc:
        return _user_error(exc)
    print(f"exported {report['tensors']} tensors ({report['parameters']:,} parameters) -> {args.dst} ({fmt})")
    return 0


def _cmd_suggest(args) -> int:
    from .suggest import Links, read_model
    from .suggest.model import hand_written_world
    from .suggest.output import as_json, parse_bytes, table, write_yaml
    from .suggest.search import search

    try:
        memory = parse_bytes(args.device_memory)
    except ValueError:
        print(f"error: --device-memory {args.device_memory!r}: write e.g. 80GiB, 64GB or 512MiB", file=sys.stderr)
        return 2
    bad = [n for n, v in (("--intra-bw", args.intra_bw), ("--inter-bw", args.inter_bw), ("--flops", args.flops),
                          ("--mfu", args.mfu), ("--headroom", args.headroom), ("--devices-per-node",
                          args.devices_per_node), ("--top", args.top), ("--device-memory", memory)) if not v > 0]
    if bad or (args.world_size is not None and args.world_size < 1):
        print(f"error: {', '.join(bad) or '--world-size'} must be positive", file=sys.stderr)
        return 2
    links = Links(intra_bw=args.intra_bw * 1e9, inter_bw=args.inter_bw * 1e9, devices_per_node=args.devices_per_node,
                  flops=args.flops, mfu=args.mfu)
    if args.calibrate:
        from .suggest.calibrate import calibrate

        links, report = calibrate(links)
        print("calibrated: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in report.items()), file=sys.stderr)
    spec = read_model(args.model, args.seq_length, args.global_batch_size)
    world = args.world_size or (hand_written_world(args.model) if spec.base.get("parallel_config") else None)
    if world is None:
        print("error: --world-size is needed (the model file gives no degrees)", file=sys.stderr)
        return 2
    if spec.parallel_mode == "auto_parallel":
        print("note: the YAML sets parallel_mode auto_parallel: suggest's best layout is the strategy "
              "(msparallel_ds.suggest.resolve_auto_parallel)", file=sys.stderr)
    res = search(spec, world, memory, links, headroom=args.headroom)
    print(as_json(res, args.top, links) if args.format == "json" else table(res, args.top))
    if args.output and res.candidates:
        try:
            write_yaml(res.candidates[0], args.output, world, links)
        except OSError as exc:
            print(f"error: cannot write -o {args.output}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.output}: {res.candidates[0].label}", file=sys.stderr)
    return 0 if res.candidates else 1


def _cmd_train(args) -> int:
    from .run.launch import run

    run(args)
    return 0


def _cmd_validate(args) -> int:
    worst = 0
    for f in args.files:
        with warnings.catch_warnings(record=True) as caught:  # each file's warnings under its own line
            warnings.simplefilter("always", ConfigWarning)
            try:
                plan = _plan(f, args.world_size)
                m = plan.mesh
                print(f"ok    {f}: world {plan.world_size} (pp {m.pp}, dp {m.dp}, cp {m.cp}, tp {m.tp}), "
                      f"global batch {plan.global_batch_size}, ZeRO {plan.zero.stage}")
            except ConfigError as exc:
                worst = max(worst, 2)
                detail = "; ".join(str(i) for i in exc.issues)
                print(f"error {f}: {detail}")
        sys.stdout.flush()
        for w in caught:
            if issubclass(w.category, ConfigWarning):
                print(f"warning: {f}: {w.message}", file=sys.stderr)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return worst


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    handler = {"plan": _cmd_plan, "export": _cmd_export, "validate": _cmd_validate, "demo": _cmd_demo,
               "convert-checkpoint": _cmd_convert, "import-mindspore": _cmd_import,
               "export-mindspore": _cmd_export_ms, "suggest": _cmd_suggest, "train": _cmd_train}[args.command]
    with warnings.catch_warnings():
        warnings.simplefilter("default", ConfigWarning)
        show = warnings.showwarning
        warnings.showwarning = lambda msg, cat, *a, **k: print(f"warning: {msg}", file=sys.stderr)
        try:
            return _run(handler, args)
        finally:
            warnings.showwarning = show


def _run(handler, args) -> int:
    try:
        return handler(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except Exception:  # an internal bug, not the user's config: show where
        traceback.print_exc()
        print("msparallel-ds: internal error (please report it with the YAML that caused it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
