#!/usr/bin/env bash
# One prepared GPU check: installs JAX CUDA into a throwaway venv and runs the transfer benchmark on
# the GPU backend (XLA gather/scatter kernels, pinned_host per-page host pool), then prints H2D/D2H
# GB/s against the PCIe figure. CI stays CPU-only; run this by hand on a machine with an NVIDIA GPU.
#
#   bash benchmarks/gpu_transfer_check.sh [OUT_DIR]        # ~3-5 min incl. the pip install
#
# PCIE_GBPS (default 25, i.e. PCIe 4.0 x16 effective; H100/H200 on PCIe 5.0: ~50) is the reference.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-out/gpu_transfer}}
PCIE_GBPS=${PCIE_GBPS:-25}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$OUT/gpu.txt"
# PYTHON: an interpreter that already has JAX CUDA and hicache (no network needed); otherwise a
# throwaway venv is created and both are installed into it.
if [ -z "${PYTHON:-}" ]; then
  VENV=${VENV:-/tmp/hicache-gpu-venv}
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q -e . "jax[cuda12]"
  fi
  PYTHON="$VENV/bin/python"
fi
"$PYTHON" -c "import jax, hicache.workers; print(jax.devices()); assert jax.default_backend() == 'gpu'"
"$PYTHON" benchmarks/transfer_bench.py --platform cuda --pool-mib 256 4096 \
    --page-kib 64 1024 --batches 1 16 256 --reps 10 --json "$OUT/transfer.json" | tee "$OUT/transfer.log"
"$PYTHON" - "$OUT/transfer.json" "$PCIE_GBPS" <<'PY'
import json, sys
recs = [r for r in json.load(open(sys.argv[1])) if r["direction"] in ("d2h", "h2d")]
pcie = float(sys.argv[2])
for d in ("d2h", "h2d"):
    best = max((r for r in recs if r["direction"] == d), key=lambda r: r["gbps"])
    print(f"{d}: best {best['gbps']:.2f} GB/s = {100 * best['gbps'] / pcie:.0f}% of PCIe {pcie} GB/s "
          f"(batch {best['batch_pages']} x {best['page_bytes'] >> 10} KiB, pool {best['pool_bytes'] >> 20} MiB)")
PY
