#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one run: the `gpu` tests, then the GPU rows of the
# benchmarks (host<->device copies and GDS, device prefetch, inference and training on CUDA,
# dequantization on the device), each benchmark's JSON in OUTDIR. Run it where torch sees
# CUDA, with tierstore's requirements installed ('.[gpu]' or '.[gpu-cu13]' adds kvikio); the CPU suite
# (scripts/test.sh) does not need it. Every step has a time limit, so one stuck step costs
# only its own figures; the log (appended to) and a line per step (exit status, seconds) go
# to OUTDIR. Name steps to run only those, e.g. the tests in one session and the benchmarks
# in another: machine, tests, tiers, dequant, prefetch, infer, train, quantized.
#
#   scripts/gpu.sh [OUTDIR [STEP...]]      (default: gpu-results, every step)
set -uo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
fi
OUT="${1:-gpu-results}"
shift $(($# > 0 ? 1 : 0))
ALL="machine tests tiers dequant prefetch infer train quantized"
STEPS=" ${*:-$ALL} "
for s in $STEPS; do
    [[ " $ALL " == *" $s "* ]] || { echo "gpu.sh: no step '$s'; the steps: $ALL" >&2; exit 2; }
done
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu.sh: torch ($PY) sees no CUDA device here; scripts/test.sh runs the CPU suite" >&2
    exit 2
fi
mkdir -p "$OUT"
LOG="$OUT/gpu.log"
touch "$LOG"

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 start rc
    shift 2
    [[ "$STEPS" == *" $name "* ]] || return 0
    start=$(date +%s)
    echo "== $name: $*" | tee -a "$LOG"
    PYTHONUNBUFFERED=1 timeout "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    echo "== $name: exit $rc in $(($(date +%s) - start)) s" | tee -a "$LOG"
}

step machine 60 "$PY" - <<'EOF'
import platform, torch, transformers
print(platform.node(), platform.python_version(), "torch", torch.__version__,
      "transformers", transformers.__version__)
print("cuda", torch.cuda.is_available(), torch.version.cuda,
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
try:
    import kvikio, kvikio.defaults
    print("kvikio", kvikio.__version__, "compat mode", kvikio.defaults.get("compat_mode"))
except Exception as e:  # the engine's absence is a finding, not a failure
    print("kvikio: not usable:", e)
import tierstore
try:
    with tierstore.open("gpu-probe-store", create=True, engine="kvikio", host_cache=0) as st:
        x = torch.randn(1 << 20)
        st.put("x", x)
        print(st.describe(), "| a read onto cuda equals the tensor put:",
              torch.equal(st.get("x", device="cuda").cpu(), x))
except (tierstore.StoreError, RuntimeError) as e:
    print("a store on the kvikio engine:", e)
EOF
rm -rf gpu-probe-store
step tests 600 "$PY" -m pytest -m gpu -q -rfEs -p no:cacheprovider tests
step tiers 60 "$PY" -m tierstore bench tiers --tiers gpu,host --blocks 1MiB,16MiB,64MiB \
    --threads 8 --total 512MiB --repeat 3 --json "$OUT/tiers-gpu.json"
step dequant 60 "$PY" -m tierstore bench dequant --device cuda --json "$OUT/dequant-cuda.json"
step prefetch 120 "$PY" -m tierstore bench prefetch --device cuda --json "$OUT/prefetch-cuda.json"
step infer 180 "$PY" -m tierstore bench infer --device cuda --repeats 3 \
    --decode-tokens 32 --json "$OUT/infer-cuda.json"
step train 180 "$PY" -m tierstore bench train --device cuda --model small --rounds 2 --steps 4 \
    --warmup 2 --json "$OUT/train-cuda.json"
step quantized 300 "$PY" -m tierstore bench infer --peer accelerate --quantized mxfp4 \
    --device cuda --layers 8 --experts 24 --hidden 1024 --ffn 2048 --prefill-len 16 \
    --decode-tokens 8 --rounds 1 --json "$OUT/quant-mxfp4-cuda.json"
grep '^== .*: exit' "$LOG" | tail -n "$(wc -w <<<"$STEPS")"
