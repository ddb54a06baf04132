#!/bin/bash
# colibri and llama.cpp on the same full-size OLMoE checkpoints, all resident, one engine
# after the other within a round (the machines are noisy: compare within a round).
#
#   benchmarks/resident_rounds.sh BENCH_DIR OUT_DIR [ROUNDS]
#
# BENCH_DIR holds olmoe-full-q4q4, olmoe-full-int8, olmoe-full-int4 (colibri convert)
# and olmoe-q4_0.gguf, olmoe-q8_0.gguf (llama_cpp_bench.py); COLIBRI and LLAMA_PYTHON
# name the two environments' executables (defaults: colibri, python).
set -euo pipefail
bench=$1 out=$2 rounds=${3:-2}
colibri=${COLIBRI:-colibri}
llama="${LLAMA_PYTHON:-python} $(dirname "$0")/llama_cpp_bench.py run"
opts="--preload --tokens 32 --prompt-tokens 32 --repeats 3 --temperature 1 --json"
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  $colibri bench --model "$bench/olmoe-full-q4q4" $opts > "$out/r${round}_colibri_q4q4.json"
  $llama --gguf "$bench/olmoe-q4_0.gguf" --tokens 32 --repeats 3 > "$out/r${round}_llama_q4_0.json"
  $colibri bench --model "$bench/olmoe-full-int8" $opts > "$out/r${round}_colibri_int8.json"
  $llama --gguf "$bench/olmoe-q8_0.gguf" --tokens 32 --repeats 3 > "$out/r${round}_llama_q8_0.json"
  $colibri bench --model "$bench/olmoe-full-int4" $opts > "$out/r${round}_colibri_int4.json"
done
