#!/usr/bin/env bash
# tools/gpu_check.sh OUTDIR: the one script to run on the GPU host (one H200, Python 3.12, CuPy,
# torch; the project's notes on it, ../shared/gpu/GPU_HOST.md, lie outside this repository, beside
# the developers' checkout). It finishes within 5 minutes (every step has a timeout,
# all of them drawn from one budget) and writes, in OUTDIR:
#   gpu_check.log          everything this script printed
#   gpu_smoke.log          tools/gpu_smoke.py: one ok/FAIL line per CUDA/CuPy/NCCL call rtxnet makes
#   gpu_tests.log          pytest tests/gpu (the gpu-marked tests and the others there)
#   topology.json          `rtxnet topology --json`
#   digits.log             examples/train_digits.py --device cuda, 4 ranks on the GPU, rank 2 killed
#   digits_metrics.json    its metrics.json
#   gpu_bench.json/.png    tools/bench/collectives.py --device cuda --compare boards (IPC, 2 and 4
#                          ranks, 8 B..1 GiB; by default and with RTXNET_IPC_BOARD=1)
# and ends with a summary (test counts, training result, bench fractions of the copy-rate limit).
# Exit code: 0 all passed; 1 a step failed (the summary names it); 3 no usable CUDA device (the
# GPU steps were skipped); 2 usage.
#
# How to run it from a session (the working tree travels; .whl/ is git-ignored, so carry it):
#   1. here, once, from the repository root (fills .whl/ with what the host lacks: pyzmq,
#      structlog and pytest-asyncio, as the run of 2026-12-04 found; the script is the
#      developers' tool, outside this repository, not in a clone; elsewhere: pip download
#      --only-binary=:all: --python-version 3.12 -d .whl pyzmq structlog pytest-asyncio):
#        ../shared/gpu/fetch-wheels.sh
#      (the digits example needs no scikit-learn there: it reads examples/data/digits_seed0.npz;
#      tqdm and matplotlib are optional)
#   2. the device tool's run, with carry [".whl"] and timeout_s 420:
#        bash tools/gpu_check.sh "$OUT"
#      then read the summary at the end of output_tail; the files above come back from $OUT.
#   A rerun of a part: GPU_CHECK_STEPS="tests bench" (any of: tests digits bench), and
#   GPU_CHECK_BENCH_ARGS="--max-bytes 256MiB" (extra bench arguments), GPU_CHECK_PYTEST_ARGS
#   (e.g. "-k ipc"), GPU_CHECK_BUDGET_S (default 270: with the kill graces and the
#   summary the run stays within 5 minutes).
# Off the GPU host (a dry run): PYTHON=.venv/bin/python bash tools/gpu_check.sh /tmp/x  gets
# through installation and pytest (GPU tests skip), skips the GPU steps and exits 3.
set -uo pipefail

if [[ $# -ne 1 || -z "$1" ]]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUTDIR=$(cd "$1" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$PWD
PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
STEPS=${GPU_CHECK_STEPS:-tests digits bench}
BUDGET_S=${GPU_CHECK_BUDGET_S:-270}
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUTDIR/gpu_check.log") 2>&1
TEE_PID=$!

say() { printf '\n=== [%3ds] %s\n' "$SECONDS" "$*"; }
# Seconds a step may take: at most $1, and never so much that the later steps lose their
# minimum ($2 seconds in all).
allot() {
  local cap=$1 reserve=$2 left
  left=$((BUDGET_S - SECONDS - reserve))
  ((left < 10)) && left=10
  ((left < cap)) && cap=$left
  echo "$cap"
}
want() { [[ " $STEPS " == *" $1 "* ]]; }

declare -A RESULT=()

say "rtxnet GPU check in $ROOT, output in $OUTDIR ($(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"

# -- 1. Python packages the host lacks, from the carried wheels --------------------------------
say "python packages"
SITE=$(mktemp -d /tmp/rtxnet-site.XXXXXX)
trap 'rm -rf "$SITE"' EXIT
missing=()
# module:wheel name; typing_extensions is what pytest-asyncio needs below Python 3.13.
for pair in zmq:pyzmq structlog:structlog pytest_asyncio:pytest_asyncio ml_dtypes:ml_dtypes \
            psutil:psutil typing_extensions:typing_extensions; do
  mod=${pair%%:*} dist=${pair#*:}
  if ! "$PY" -c "import $mod" 2>/dev/null; then
    missing+=("$dist")
  fi
done
if ((${#missing[@]})); then
  files=()
  for dist in "${missing[@]}"; do
    found=("$WHEELS/$dist"-*.whl)
    if [[ -e "${found[0]}" ]]; then
      files+=("${found[0]}")
    else
      echo "no wheel for $dist in $WHEELS (run /work/shared/gpu/fetch-wheels.sh and carry .whl)"
    fi
  done
  if ((${#files[@]})); then
    echo "installing into $SITE: ${files[*]##*/}"
    timeout -k 3 40 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$SITE" "${files[@]}" || echo "pip install failed (exit $?)"
  fi
else
  echo "nothing to install: pyzmq, structlog, pytest-asyncio, ml_dtypes, psutil and typing_extensions import"
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
timeout -k 3 30 "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
bad = []
for name in ("numpy", "msgpack", "uvloop", "zmq", "structlog", "ml_dtypes", "psutil", "pytest",
             "pytest_asyncio", "pytest_timeout", "cupy", "torch", "pynvml", "sklearn", "tqdm",
             "matplotlib"):
    try:
        m = importlib.import_module(name)
        print(f"  {name:<15} {getattr(m, '__version__', getattr(m, 'VERSION', '?'))}  {m.__file__}")
    except Exception as exc:
        print(f"  {name:<15} MISSING ({type(exc).__name__}: {exc})")
        bad.append(name)
try:
    import rtxnet  # noqa: F401
    print("rtxnet imports")
except Exception as exc:
    print(f"rtxnet does NOT import: {type(exc).__name__}: {exc}")
EOF

# -- 2. What the machine is ---------------------------------------------------------------------
say "GPU, driver, CUDA, NCCL"
if command -v nvidia-smi >/dev/null; then
  timeout -k 2 15 nvidia-smi --query-gpu=index,name,driver_version,memory.total,pci.bus_id,uuid \
    --format=csv || echo "nvidia-smi failed"
else
  echo "nvidia-smi: not found"
fi
timeout -k 3 40 "$PY" - <<'EOF'
from rtxnet.collectives.gpu import cupy_available
ok, why = cupy_available()
print("cupy_available:", ok, why)
try:
    import cupy
    rt = cupy.cuda.runtime
    print(f"cupy {cupy.__version__}, CUDA runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}")
    try:
        from cupy.cuda import nccl
        print("NCCL", nccl.get_version())
    except Exception as exc:
        print(f"NCCL unavailable: {type(exc).__name__}: {exc}")
    if ok:
        from rtxnet.topology import gpu_identity
        print("gpu_identity(0):", gpu_identity(0))
except Exception as exc:
    print(f"cupy: {type(exc).__name__}: {exc}")
try:
    import torch
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available {torch.cuda.is_available()}, "
          f"devices {torch.cuda.device_count()}")
except Exception as exc:
    print(f"torch: {type(exc).__name__}: {exc}")
EOF
say "rtxnet topology"
timeout -k 2 20 "$PY" -m rtxnet.cli topology || echo "rtxnet topology failed (exit $?)"
timeout -k 2 20 "$PY" -m rtxnet.cli topology --json >"$OUTDIR/topology.json" 2>/dev/null
CUDA_OK=0
if timeout -k 3 30 "$PY" -c "import sys; from rtxnet.collectives.gpu import cupy_available as c; sys.exit(0 if c()[0] else 1)"; then
  CUDA_OK=1
fi

# -- 2b. One line per CUDA/CuPy/NCCL call the GPU path makes (pinpoints an API failure) ----------
if ((CUDA_OK)); then
  say "gpu_smoke (timeout 45s)"
  timeout -s INT -k 3 45 "$PY" tools/gpu_smoke.py 2>&1 | tee "$OUTDIR/gpu_smoke.log"
fi

# -- 3. Tests -------------------------------------------------------------------------------------
if want tests; then
  t=$(allot 180 90)
  # the collectives, fault, NCCL, DDP and topology tests first, verbose (a stopped run still
  # shows what passed); the large kernel matrix after, in what time is left, on the device only
  # (its "host" executor and the compile checks run in CI, and every kernel the device tests run
  # is compiled there by NVRTC anyway; a -k in GPU_CHECK_PYTEST_ARGS replaces that filter). The
  # kernel matrix is a sample when time runs out: its being stopped does not fail the step.
  t1=$((t * 75 / 100))
  t2=$((t - t1))
  : >"$OUTDIR/gpu_tests.log"
  say "pytest tests/gpu, integration (timeout ${t1}s)"
  # shellcheck disable=SC2086
  timeout -s INT -k 5 "$t1" "$PY" -m pytest tests/gpu/test_ipc.py tests/gpu/test_ipc_fault.py \
    tests/gpu/test_group_nccl.py tests/gpu/test_nccl_unit.py tests/gpu/test_ddp_gpu.py tests/gpu/test_topology_gpu.py \
    -v --maxfail=5 --timeout 120 -p no:cacheprovider -rfEs ${GPU_CHECK_PYTEST_ARGS:-} 2>&1 \
    | tee -a "$OUTDIR/gpu_tests.log"
  rc1=${PIPESTATUS[0]}
  ((rc1 == 124)) && echo "pytest (integration) ran past its ${t1}s and was stopped"
  say "pytest tests/gpu, kernels (timeout ${t2}s)"
  # shellcheck disable=SC2086
  timeout -s INT -k 5 "$t2" "$PY" -m pytest tests/gpu/test_kernels.py \
    -q --maxfail=5 --timeout 120 -p no:cacheprovider -rfEs -k "not host and not assembles" ${GPU_CHECK_PYTEST_ARGS:-} 2>&1 \
    | tee -a "$OUTDIR/gpu_tests.log"
  rc2=${PIPESTATUS[0]}
  if ((rc2 == 124)); then
    echo "pytest (kernels) ran past its ${t2}s and was stopped (not a failure: what ran is in the log)"
    rc2=0
  fi
  rc=$rc1
  ((rc == 0)) && rc=$rc2
  RESULT[tests]=$rc
fi

# -- 4. The digits example on the GPU, with a rank killed ---------------------------------------
if want digits; then
  if ((CUDA_OK)); then
    t=$(allot 55 45)
    say "train_digits --device cuda, 4 ranks on one GPU, kill:rank=2:step=30 (timeout ${t}s)"
    DIGITS_OUT=$(mktemp -d /tmp/rtxnet-digits.XXXXXX)
    timeout -k 5 "$t" "$PY" -m rtxnet.launcher --nproc 4 --max-restarts 1 \
      --faults "kill:rank=2:step=30" examples/train_digits.py --out "$DIGITS_OUT" --device cuda \
      --steps 80 --checkpoint-every 40 2>&1 | tee "$OUTDIR/digits.log" \
      | grep -E '^\[rank0\] (recovery|test_accuracy)|^\[rtxnet-run\]|Traceback|Error:|error:'
    rc=${PIPESTATUS[0]}
    RESULT[digits]=$rc
    cp "$DIGITS_OUT/metrics.json" "$OUTDIR/digits_metrics.json" 2>/dev/null
    rm -rf "$DIGITS_OUT"
  else
    say "train_digits --device cuda: skipped, no usable CUDA device"
  fi
fi

# -- 5. Benchmark ---------------------------------------------------------------------------------
if want bench; then
  if ((CUDA_OK)); then
    t=$(allot 100 10)
    say "bench: tools/bench/collectives.py --device cuda (timeout ${t}s)"
    # shellcheck disable=SC2086
    timeout -k 5 "$t" "$PY" tools/bench/collectives.py --device cuda --ranks 2 4 \
      --compare boards --out "$OUTDIR/gpu_bench.json" ${GPU_CHECK_BENCH_ARGS:-}
    RESULT[bench]=$?
  else
    say "bench --device cuda: skipped, no usable CUDA device"
  fi
fi

# -- 6. Summary -------------------------------------------------------------------------------------
say "summary"
export GPU_CHECK_OUTDIR=$OUTDIR GPU_CHECK_CUDA_OK=$CUDA_OK
for k in tests digits bench; do
  export "GPU_CHECK_RC_${k}=${RESULT[$k]:-not run}"
done
"$PY" - <<'EOF'
import json, os, re
out = os.environ["GPU_CHECK_OUTDIR"]
rc = {k: os.environ.get(f"GPU_CHECK_RC_{k}", "not run") for k in ("tests", "digits", "bench")}


def read(name):
    try:
        with open(os.path.join(out, name), errors="replace") as f:
            return f.read()
    except OSError:
        return None


smoke = read("gpu_smoke.log")
if smoke is not None:
    for line in smoke.splitlines():
        if line.startswith(("FAIL", "gpu_smoke:")):
            print(line[:200])

log = read("gpu_tests.log")
if log is not None:
    ends = [line for line in log.splitlines()
            if re.search(r"\b\d+ (passed|failed|skipped|errors?)\b.* in [\d.]+s", line)]
    for end in ends or [""]:
        counts = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", end)
        print(f"tests: {', '.join(f'{n} {w}' for n, w in counts) or 'no pytest summary line'}")
    print(f"tests exit {rc['tests']}")
    for line in log.splitlines():
        if line.startswith(("FAILED", "ERROR")):
            print("  " + line[:200])
else:
    print(f"tests: {rc['tests']}")

d = read("digits.log")
if d is not None:
    keep = [line for line in d.splitlines() if line.startswith(("[rank0] recovery", "[rank0] test_accuracy"))]
    print(f"digits --device cuda (4 ranks, kill rank 2 at step 30): exit {rc['digits']}")
    for line in keep:
        print("  " + line[:240])
else:
    print(f"digits: {rc['digits']}")

b = read("gpu_bench.json")
if b:
    every = json.loads(b)
    rows = [r for r in every if r.get("impl", "rtxnet") == "rtxnet"]
    alt = {(r["op"], r["ranks"], r["nbytes"]): r for r in every if r.get("impl") == "rtxnet-boards"}
    if rows:
        r0 = rows[0]
        print(f"bench: exit {rc['bench']}; GPU {r0.get('gpu')}, copy rate {r0['copy_rate_gbps']:.0f} GB/s "
              f"(read + written); fraction of algbw_max ({r0['limit']} for all_reduce), iterations "
              f"back to back [after a barrier each] (RTXNET_IPC_BOARD=1: back to back):")
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        for n in sorted({r["ranks"] for r in rows}):
            sel = sorted((r for r in rows if r["op"] == op and r["ranks"] == n), key=lambda r: r["nbytes"])
            if not sel:
                continue
            def frac(r):
                m = alt.get((r["op"], r["ranks"], r["nbytes"]))
                return (f"{r['nbytes'] >> 20}MiB:{r['frac_of_limit'] * 100:.0f}%"
                        f"[{r.get('frac_of_limit_barrier', 0) * 100:.0f}%]"
                        + (f"({m['frac_of_limit'] * 100:.0f}%)" if m else ""))
            big = " ".join(frac(r) for r in sel if r["nbytes"] >= 1 << 20)
            def lat(r):
                m = alt.get((r["op"], r["ranks"], r["nbytes"]))
                return (f"{r['nbytes']}B:{r['time_s'] * 1e6:.0f}us"
                        f"[{r.get('time_barrier_s', 0) * 1e6:.0f}us]"
                        + (f"({m['time_s'] * 1e6:.0f}us)" if m else ""))
            small = " ".join(lat(r) for r in sel if r["nbytes"] < 1 << 20)
            print(f"  {op:<15} n={n}  {big}  | latency {small}")
    for name, sel in (("default", rows), ("RTXNET_IPC_BOARD=1", list(alt.values()))):
        target = [r for r in sel if r["op"] == "all_reduce" and r["nbytes"] >= 256 << 20]
        if target:
            worst = min(r["frac_of_limit"] for r in target)
            worst_b = min(r.get("frac_of_limit_barrier", 0) for r in target)
            print(f"  {name}: all_reduce >= 256MiB: worst {worst * 100:.0f}% of the limit back to "
                  f"back, {worst_b * 100:.0f}% after a barrier each (target 50%): "
                  f"{'MET' if worst >= 0.5 else 'NOT MET'}")
    for r in (r for r in every if r["op"] == "all_reduce" and r.get("phases_us")
              and r["nbytes"] in (8, 256 << 20)):
        ph = " ".join(f"{k}:{v:.0f}" for k, v in r["phases_us"].items())
        print(f"  {r.get('impl')} all_reduce n={r['ranks']} {r['nbytes']}B: "
              f"{r.get('time_barrier_s', r['time_s']) * 1e6:.0f}us after a barrier; IPC phases "
              f"(us from the exchange's start) {ph}; hellos {r.get('hellos')}")
    wrong = [f"{r.get('impl')} {r['op']} n={r['ranks']} {r['nbytes']}B" for r in every if not r.get("ok", True)]
    print(f"  wrong results: {', '.join(wrong) if wrong else 'none'}")
else:
    print(f"bench: {rc['bench']}")
if os.environ["GPU_CHECK_CUDA_OK"] != "1":
    print("NO USABLE CUDA DEVICE: the GPU steps were skipped")
EOF

status=0
for k in tests digits bench; do
  v=${RESULT[$k]:-}
  if [[ -n "$v" && "$v" != 0 ]]; then
    echo "FAILED step: $k (exit $v)"
    status=1
  fi
done
if ((status == 0 && CUDA_OK == 0)); then
  status=3
fi
echo "gpu_check: exit $status after ${SECONDS}s"
exec >&- 2>&-      # let tee write the last lines into gpu_check.log before the script ends
wait "$TEE_PID" 2>/dev/null
exit "$status"
