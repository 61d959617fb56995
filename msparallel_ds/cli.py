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
    c.add_argument("--to-config", required=True, help="MindFormers YAML of the run that will load it")
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
    return ap


def _plan(path: str, world_size: Optional[int]):
    from .config.mindformers import load_config
    from .plan import make_plan

    return make_plan(load_config(Path(path)), world_size=world_size)


def _cmd_plan(args) -> int:
    plan = _plan(args.file, args.world_size)
    print(plan.to_json() if args.format == "json" else plan.summary())
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
               "export-mindspore": _cmd_export_ms}[args.command]
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
