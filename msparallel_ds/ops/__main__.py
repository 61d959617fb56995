"""python -m msparallel_ds.ops {build,check,info}

build   compile the extension ahead of time into $TORCH_EXTENSIONS_DIR (needs a CUDA build of torch, nvcc and ninja;
        no GPU needed) and import it
check   compile every kernel .cu with nvcc alone (no torch headers, no GPU) for the given archs; what CI runs
info    where the sources are, the build cache, and whether the kernels can run here
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

from . import _build


def _build_cmd(args) -> int:
    t0 = time.perf_counter()
    try:
        mod = _build.load(build=True, require_device=False, verbose=args.verbose)
    except _build.OpsUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"built {mod.__name__} from {_build.source_dir()} in {time.perf_counter() - t0:.1f} s "
          f"(cache {_build.build_directory()})")
    return 0


def _check_cmd(args) -> int:
    try:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            results = _build.compile_check(tmp, args.arch, jobs=args.jobs)
    except _build.OpsUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    bad = 0
    for r in results:
        print(f"{'ok  ' if r.returncode == 0 else 'FAIL'} {r.source:<18} sm_{r.arch.replace(',', ' sm_'):<14} "
              f"{r.seconds:6.1f} s")
        if r.returncode:
            bad += 1
            print(r.output, file=sys.stderr)
    print(f"{len(results) - bad}/{len(results)} compiled in {time.perf_counter() - t0:.1f} s wall")
    return 1 if bad else 0


def _info_cmd(args) -> int:
    try:
        print(f"sources: {_build.source_dir()}")
    except _build.OpsUnavailable as exc:
        print(f"sources: {exc}")
    print(f"nvcc: {_build.find_nvcc() or 'not found'}")
    print(f"archs: {', '.join('sm_' + a for a in _build.archs())} (+ compute_80 PTX)")
    reason = _build.unavailable_reason()
    print(f"runnable here: {'yes' if reason is None else 'no: ' + reason}")
    if _build.unavailable_reason(require_device=False) is None:
        print(f"build cache: {_build.build_directory()} ({'built' if _build.is_built() else 'not built'})")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m msparallel_ds.ops", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="JIT-compile the extension into the torch extensions cache")
    b.add_argument("--verbose", action="store_true")
    c = sub.add_parser("check", help="nvcc compile-only check of the kernels (no torch, no GPU)")
    c.add_argument("--arch", action="append", default=None, help="e.g. 80, 90a (repeatable; default 80 and 90a)")
    c.add_argument("--jobs", type=int, default=None)
    sub.add_parser("info", help="sources, cache and availability")
    args = ap.parse_args(argv)
    if args.cmd == "check" and not args.arch:
        args.arch = list(_build.DEFAULT_ARCHS)
    return {"build": _build_cmd, "check": _check_cmd, "info": _info_cmd}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
