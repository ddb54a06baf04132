#!/usr/bin/env bash
# The GPU check of colibri-cuda, prepared for one run on a machine with an NVIDIA GPU and
# no network (the device machine: python3 there has CuPy for CUDA 13, numpy, torch,
# pytest, setuptools; README.md of this folder says what was verified where).
#
#   here, with network, once:  bash backends/colibri-cuda/gpu_check.sh fetch
#       downloads the wheels the GPU machine lacks into backends/colibri-cuda/.gpu-wheels
#       (git-ignored; ~14 MB: transformers as colibri's tests pin it, platformdirs)
#   there, from the repository root, the folder carried along:
#       OUT=/some/dir bash backends/colibri-cuda/gpu_check.sh
#
# Steps, each bounded by a timeout, each logged under $OUT (summary.txt says what passed):
#   1. install: the carried wheels, then colibri-core, the families and colibri-cuda
#      (editable: the CPU kernels are built for this python)
#   2. colibri list-backends: cuda available on the gpu
#   3. colibri-cuda's own tests (layouts, mirrors, nvcc for sm_80/sm_90)
#   4. the conformance kit on cuda (every kernel against the numpy reference)
#   5. a small decode benchmark on a synthetic OLMoE-shaped checkpoint with int4 experts
#      (full-size widths, 2 layers): cuda with every expert in VRAM, with a quarter of
#      them, with none (each uploaded when used), and cpu, in one run; cuda's tokens
#      compared between the placements
#   6. every family's oracle cases on cuda (tokens identical to transformers)
# Bounded at about 10 minutes in all (each step's timeout); give the run 600 s.
# Without a usable GPU it installs nothing and exits 2 with one line saying why.
set -uo pipefail
cd "$(dirname "$0")/../.."
HERE=backends/colibri-cuda
WHEELS=$HERE/.gpu-wheels
PYTHON=${PYTHON:-python3}

if [ "${1:-}" = fetch ]; then
    mkdir -p "$WHEELS"
    exec "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" transformers==5.23.0 platformdirs==4.14.9
fi

OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
# step NAME SECONDS LOG COMMAND...: run it bounded, log it, record its status
step() {
    local name=$1 seconds=$2 log=$3
    shift 3
    local started=$SECONDS
    timeout "$seconds" "$@" >> "$OUT/$log" 2>&1
    local status=$?
    note "$name: $([ $status = 0 ] && echo passed || echo "FAILED (exit $status)") in $((SECONDS - started)) s, log $log"
    return $status
}

reason=$("$PYTHON" -c "
import cupy
n = cupy.cuda.runtime.getDeviceCount()
assert n > 0, 'no CUDA device'
print(cupy.cuda.runtime.getDeviceProperties(0)['name'].decode(), cupy.__version__)" 2>&1)
if [ $? != 0 ]; then
    echo "gpu_check: no usable GPU here: $(echo "$reason" | tail -1)" | tee -a "$SUMMARY"
    exit 2
fi
note "gpu: $reason"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$SUMMARY" 2>&1

export PYTHONUNBUFFERED=1 CUPY_TF32=0
step install 90 install.log bash -c "
    set -e
    if ls $WHEELS/*.whl > /dev/null 2>&1; then $PYTHON -m pip install -q --no-index --no-deps $WHEELS/*.whl; fi
    $PYTHON -m pip install -q --no-index --no-deps --no-build-isolation -e . \
        $(for f in families/colibri-*; do printf -- '-e %s ' "$f"; done) -e $HERE
    $PYTHON -c 'import transformers, colibri_core; print(\"transformers\", transformers.__version__)'
" || exit 1
COLIBRI="$PYTHON -m colibri_core"

step list-backends 30 install.log bash -c "$COLIBRI list-backends && $COLIBRI list-backends --json | $PYTHON -c '
import json, sys
rows = {r[\"backend\"]: r for r in json.load(sys.stdin)}
assert rows[\"cuda\"][\"available\"] and rows[\"cuda\"][\"device\"] == \"gpu\", rows[\"cuda\"]'"

export COLIBRI_TEST_BACKENDS=cuda
step unit-tests 45 unit.log "$PYTHON" -m pytest -q -n 4 -p no:cacheprovider "$HERE/tests" -k "not install"
step conformance 90 conformance.log "$PYTHON" -m pytest -q -n 4 -p no:cacheprovider \
    tests/test_backend_conformance_installed.py -k cuda

# -- the benchmark --------------------------------------------------------------------------
BENCH=$(mktemp -d)
step bench-model 100 bench.log bash -c "
    set -e
    $PYTHON benchmarks/synthetic_olmoe.py --out $BENCH/bf16 --hidden 2048 --intermediate 1024 --experts 64 \
        --top-k 8 --heads 16 --vocab 50304 --layers 2 --skew 1.0
    $COLIBRI convert --model $BENCH/bf16 --out $BENCH/int4 --experts int4 --dense bf16
    rm -rf $BENCH/bf16"
quarter=$("$PYTHON" -c "
from colibri_cuda.layouts import packed_nbytes
print(2 * 16 * 3 * packed_nbytes('q4', (1024, 2048)))")  # 2 layers x 16 of 64 experts x 3 matrices
bench() {
    local label=$1
    shift
    step "bench $label" 30 bench.log bash -c "$COLIBRI bench --model $BENCH/int4 --tokens 64 --prompt-tokens 16 \
        --repeats 1 --preload --json $* | $PYTHON -c '
import json, sys
run = json.load(sys.stdin)
print(json.dumps({\"label\": \"$label\", \"run\": run}))' >> $OUT/bench.jsonl"
}
bench cuda-all-in-vram --backend cuda
bench cuda-quarter-in-vram --backend cuda --vram "$quarter"
bench cuda-none-in-vram --backend cuda --vram 0
bench cpu --backend cpu
"$PYTHON" - "$OUT/bench.jsonl" >> "$SUMMARY" 2>&1 <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
runs = {row["label"]: row["run"]["runs"]["colibri"][0] for row in rows}
for label, run in runs.items():
    if "error" in run:
        print(f"{label}: error {run['error']}")
        continue
    print(f"{label}: decode {run['decode_tok_s']:.1f} tok/s, prefill {run['prefill_s']:.3f} s, "
          f"hit rate {run.get('hit_rate')}")
# placements change speed only: cuda's tokens must not depend on what VRAM holds (the cpu
# backend's int4 kernels quantise activations, so its tokens are no yardstick here)
tokens = {label: run.get("token_ids") for label, run in runs.items() if label.startswith("cuda")}
same = len({tuple(t or ()) for t in tokens.values()}) == 1
print("cuda placements generate the same tokens" if same else f"CUDA PLACEMENTS DIFFER: {tokens}")
PY
rm -rf "$BENCH"
step oracles 120 oracles.log "$PYTHON" -m pytest -q -n 8 -p no:cacheprovider families -k cuda
note "done: $(grep -c FAILED "$SUMMARY") step(s) failed"
