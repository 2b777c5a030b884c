#!/usr/bin/env bash
# One prepared GPU check of the data plane and the engine on JAX's GPU backend (CI stays CPU-only):
#   1. gpu_data_plane_check.py: L1 (HBM) <-> L2 (pinned_host) round trips bit-identical, per layout
#   2. transfer_bench.py on cuda: H2D/D2H GB/s per batch/page/pool size, best against PCIE_GBPS
#   3. tests/engine/test_model.py on the GPU (cached vs recomputed KV and logits bit-identical)
#   4. multiturn.py with the model on the GPU: every config's outputs equal the no-cache reference
#      (spot checks compare logits too; a mismatch exits non-zero), TTFT/overhead with host cores free
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]     # ~4-6 min on an H200 with JAX CUDA already installed
#
# PYTHON: an interpreter with JAX CUDA (default python3). hicache need not be installed there: when
# it is not importable, a package shim of this checkout goes on PYTHONPATH (no network needed; the
# core needs no Ray or gcsfs). Without JAX CUDA at all, VENV=... makes a venv and pip-installs
# `-e . jax[cuda12]` (needs a package registry). PCIE_GBPS (default 25: PCIe 4.0 x16 effective;
# H100/H200 on PCIe 5.0 ~50) is the reference for the GB/s verdict. Each step has its own timeout;
# STEPS (default "data_plane transfer engine_tests multiturn") picks steps, MULTITURN_ARGS adds multiturn flags,
# GPU_CHECK_PLATFORM=cpu FORCE_SHIM=1 dry-runs the script here.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-${OUT:-out/gpu_check}}
PCIE_GBPS=${PCIE_GBPS:-25}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv || true; } | tee "$OUT/gpu.txt"
if [ -n "${VENV:-}" ]; then
  [ -x "$VENV/bin/python" ] || { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q -e . "jax[cuda12]"; }
  PYTHON="$VENV/bin/python"
fi
PYTHON=${PYTHON:-python3}
R=$ROOT  # the root the benchmark scripts run from (they put their parent folder first on sys.path)
if [ -n "${FORCE_SHIM:-}" ] || ! "$PYTHON" -c "import hicache.workers" 2>/dev/null; then
  R=$(mktemp -d)  # a mirror root: the hicache package with its sub-packages linked in, the benchmarks
  cp -r hicache benchmarks "$R/"
  for d in cluster workers storage kernels; do rm -rf "$R/hicache/$d"; ln -s "$ROOT/$d" "$R/hicache/$d"; done
  export PYTHONPATH="$R${PYTHONPATH:+:$PYTHONPATH}"
fi
export JAX_PLATFORMS=${GPU_CHECK_PLATFORM:-cuda} PYTHONUNBUFFERED=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
"$PYTHON" -c "import jax, numpy; print('jax', jax.__version__, 'numpy', numpy.__version__, jax.devices())" | tee "$OUT/env.txt"
status=0
STEPS=" ${STEPS:-data_plane transfer engine_tests multiturn} "
step() {  # step NAME SECONDS CMD...: runs CMD (if NAME is in $STEPS) with a timeout, logs to $OUT/NAME.log
  local name=$1 secs=$2; shift 2
  [[ "$STEPS" == *" $name "* ]] || return 0
  echo "== $name"
  timeout "$secs" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name rc=$rc"
  [ "$rc" = 0 ] || status=1
}
step data_plane 120 "$PYTHON" "$R"/benchmarks/gpu_data_plane_check.py --json "$OUT/data_plane.json"
step transfer 180 "$PYTHON" "$R"/benchmarks/transfer_bench.py --platform "$JAX_PLATFORMS" --pool-mib 256 2048 \
    --page-kib 64 1024 --batches 1 16 256 --reps 5 --json "$OUT/transfer.json"
[ -f "$OUT/transfer.json" ] && "$PYTHON" - "$OUT/transfer.json" "$PCIE_GBPS" <<'PY'
import json, sys
recs = [r for r in json.load(open(sys.argv[1])) if r.get("direction") in ("d2h", "h2d")]
pcie = float(sys.argv[2])
for d in ("d2h", "h2d"):
    best = max((r for r in recs if r["direction"] == d), key=lambda r: r["gbps"])
    print(f"{d}: best {best['gbps']:.2f} GB/s = {100 * best['gbps'] / pcie:.0f}% of PCIe {pcie} GB/s "
          f"(batch {best['batch_pages']} x {best['page_bytes'] >> 10} KiB, pool {best['pool_bytes'] >> 20} MiB)")
PY
step engine_tests 150 "$PYTHON" -m pytest "$ROOT"/tests/engine/test_model.py -q -p no:cacheprovider
step multiturn 200 "$PYTHON" "$R"/benchmarks/multiturn.py --json "$OUT/multiturn.json" ${MULTITURN_ARGS:-}
echo "gpu_check: $([ $status = 0 ] && echo PASS || echo FAIL) (logs in $OUT)"
exit $status
