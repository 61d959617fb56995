#!/usr/bin/env bash
# The project's GPU run in one call: benchmarks/gpu/run.sh OUTDIR   (from anywhere; it cd's to the repo root)
#
# Stages, cheap and vital first; each is time-boxed with `timeout`, writes OUTDIR/<stage>.log and OUTDIR/<stage>.json
# (status "ok" / "failed (rc=N)" / "timeout after T s" / "skipped: <why>", plus what the stage measured) as soon as
# it ends, and a failing stage never stops the later ones:
#   0_install_wheels      carried wheels (.gpu_wheels/, benchmarks/gpu/build_wheels.sh) into a private --target folder
#   1_env                 GPU, driver, torch / CUDA, nvcc, compute capability, where each package was imported from
#   2_build_ops           JIT build of ops/ (msparallel_ds.ops) for this GPU's arch only
#   3_gpu_tests           tests/test_ops_gpu.py (+ test_ops_ring_steps.py), -x, per-test timeout, JUnit XML
#   4a/4b/4c              benchmarks/ring_kernels.py parts a (step kernels vs flash), b (one-process ring
#                         efficiency), c (bf16 error ring N vs 1), one process each
#   5_train_step          benchmarks/gpu/train_step.py: world-1 1.1B Llama, msp.initialize vs DeepSpeed ZeRO-0
# The whole run stays under MSP_GPU_BUDGET_S (default 530 s): a stage gets min(its cap, what is left minus the time
# kept for the stages after it). Without CUDA every GPU stage is written as "skipped: no CUDA" (a CPU dry run).
# One GPU, one process per stage: nothing here starts a multi-rank process group.
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 2
if [ $# -lt 1 ]; then echo "usage: benchmarks/gpu/run.sh OUTDIR" >&2; exit 2; fi
mkdir -p "$1" && OUTDIR=$(cd "$1" && pwd) || exit 2
PY=${PYTHON:-python3}
BUDGET=${MSP_GPU_BUDGET_S:-530}
DEADLINE=$(( $(date +%s) + BUDGET ))
WHEELS=${MSP_GPU_WHEELS:-$ROOT/.gpu_wheels}
SITE=${MSP_GPU_SITE:-/tmp/msp_gpu_site}
HELPER="$ROOT/benchmarks/gpu/stages.py"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/msp_torch_extensions}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PY OUTDIR
echo "benchmarks/gpu/run.sh: $(date -u +%FT%TZ), budget ${BUDGET} s, out $OUTDIR, python $(command -v "$PY")"
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc > /dev/null; then
    # torch's JIT build takes CUDA_HOME from nvcc's path, wrong where nvcc is a wrapper (/usr/local/bin/nvcc)
    for c in /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; do
        if [ -f "$c/include/cuda_runtime_api.h" ]; then export CUDA_HOME=$c; break; fi
    done
fi
echo "CUDA_HOME=${CUDA_HOME:-unset}"

HAS_CUDA=$(timeout 90 "$PY" -c 'import torch, sys; sys.stdout.write("1" if torch.cuda.is_available() else "0")' \
           2>/dev/null) || HAS_CUDA=0
OPS_OK=0

stage() {  # stage NAME CAP_S RESERVE_S NEED(any|cuda|ops) CMD...
    local name=$1 cap=$2 reserve=$3 need=$4; shift 4
    local log="$OUTDIR/$name.log" skip="" now left t start rc status secs
    reserve=$(( reserve * BUDGET / 530 ))  # the reserves below are written for the default budget
    now=$(date +%s); left=$(( DEADLINE - now - reserve )); t=$(( cap < left ? cap : left ))
    if [ "$need" != any ] && [ "$HAS_CUDA" != 1 ]; then
        skip="skipped: no CUDA (torch.cuda.is_available() is False)"
    elif [ "$need" = ops ] && [ "$OPS_OK" != 1 ]; then
        skip="skipped: the ops build failed (see 2_build_ops.json)"
    elif [ "$t" -lt 15 ] && [ "$t" -lt "$cap" ]; then
        skip="skipped: out of time ($(( DEADLINE - now )) s left, ${reserve} s kept for the later stages)"
    fi
    if [ -n "$skip" ]; then
        echo "$skip" > "$log"
        "$PY" "$HELPER" write "$OUTDIR" "$name" --status "$skip"
        echo "== $name: $skip"
        STAGE_RC=1
        return 0
    fi
    echo "== $name (timeout ${t} s): $*"
    start=$(date +%s)
    STAGE_TIMEOUT_S=$t timeout -k 10 "$t" "$@" > "$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    case $rc in
        0) status="ok" ;;
        124|137) status="timeout after ${t} s" ;;
        *) status="failed (rc=$rc)" ;;
    esac
    "$PY" "$HELPER" write "$OUTDIR" "$name" --status "$status" --rc "$rc" --seconds "$secs" --timeout "$t"
    echo "   $status in ${secs} s; last lines of $name.log:"
    tail -n 4 "$log" | cut -c1-200 | sed 's/^/   | /'
    STAGE_RC=$rc
}

install_wheels() {
    ls "$WHEELS"/*.whl > /dev/null || { echo "no wheels in $WHEELS (benchmarks/gpu/build_wheels.sh, carry it)"; return 1; }
    rm -rf "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
        || return 1
    ls "$SITE"
}

gpu_tests() {  # -x, per-test timeout (pytest-timeout, else one `timeout` per file), JUnit XML per file
    local files="tests/test_ops_gpu.py tests/test_ops_ring_steps.py" f rc=0 per
    if "$PY" -c 'import pytest_timeout' 2> /dev/null; then
        # --session-timeout ends the session before the stage's `timeout` would, so the JUnit XML is still written
        "$PY" -m pytest -x -q -rs -p no:cacheprovider --durations=15 --timeout=60 \
            --session-timeout=$(( ${STAGE_TIMEOUT_S:-120} - 15 )) --junitxml="$OUTDIR/3_gpu_tests.junit.xml" $files
        return $?
    fi
    per=$(( ${STAGE_TIMEOUT_S:-120} / 2 ))
    for f in $files; do
        timeout -k 5 "$per" "$PY" -m pytest -x -q -rs -p no:cacheprovider \
            --junitxml="$OUTDIR/3_gpu_tests.$(basename "$f" .py).junit.xml" "$f" || { rc=$?; break; }
    done
    return $rc
}

train_step() {
    "$PY" benchmarks/gpu/train_step.py --json "$OUTDIR/5_train_step.result.json" \
        --budget $(( ${STAGE_TIMEOUT_S:-300} - 15 ))
}
export -f gpu_tests train_step

# 0: wheels (only where CUDA is: they are built for the GPU machine's CPython 3.12)
stage 0_install_wheels 60 470 cuda install_wheels
if [ "${STAGE_RC:-1}" = 0 ]; then  # the carried packages, after the working tree and before the machine's own
    export PYTHONPATH="$ROOT:$SITE${PYTHONPATH#"$ROOT"}" PATH="$PATH:$SITE/bin"
fi
echo "PYTHONPATH=$PYTHONPATH"

# 1: environment (runs everywhere)
stage 1_env 90 440 any "$PY" benchmarks/gpu/env_report.py --json "$OUTDIR/1_env.result.json"
ARCH=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("ops_arch") or "")' \
       "$OUTDIR/1_env.result.json" 2> /dev/null)

# 2: the ops extension for this GPU only (sm_90a on H100/H200), into TORCH_EXTENSIONS_DIR
STAGE_RC=1
MSPARALLEL_OPS_ARCHS=${ARCH:-90a} MAX_JOBS=${MAX_JOBS:-16} \
    stage 2_build_ops 240 300 cuda "$PY" -m msparallel_ds.ops build --verbose
[ "$STAGE_RC" = 0 ] && OPS_OK=1
export MSPARALLEL_OPS_ARCHS=${ARCH:-90a}  # later loads hash the same flags: the cached build is reused

# 3: GPU tests
stage 3_gpu_tests 150 220 ops bash -c gpu_tests

# 4: kernel and ring measurements (one process per part, so one hang or crash costs one part)
stage 4a_ring_step_kernels 60 190 ops "$PY" benchmarks/ring_kernels.py --parts a --reps 5 \
    --json "$OUTDIR/4a_ring_step_kernels.result.json"
stage 4b_ring_efficiency 90 160 ops "$PY" benchmarks/ring_kernels.py --parts b --seqs 8192 32768 --rings 2 4 8 \
    --reps 3 --json "$OUTDIR/4b_ring_efficiency.result.json"
stage 4c_ring_error 45 150 ops "$PY" benchmarks/ring_kernels.py --parts c \
    --json "$OUTDIR/4c_ring_error.result.json"

# 5: world-1 training step, msp.initialize vs DeepSpeed ZeRO-0 (needs no ops build)
stage 5_train_step 200 0 cuda bash -c train_step

"$PY" "$HELPER" summary "$OUTDIR"
echo "benchmarks/gpu/run.sh: done $(date -u +%FT%TZ), $(( BUDGET - (DEADLINE - $(date +%s)) )) s"
