#!/usr/bin/env bash
# One pass on a GPU machine: GPU tests, kernel timings, benchmark workloads and profiles.
# Usage (repo root, on a CUDA box): bash examples/benchmarks/gpu_session.sh [STAGE...]
# Stages: tests kernels nano-qwen nano-llama nano-qwen3 nano-llama3 shared-prefix summarize score
#         peer-qwen peer-llama profile-qwen profile-llama profile-qwen-small run-qwen run-llama
#         timeline-qwen jit-qwen decode-tune placement
#         tests-moe nano-moe jit-moe moe-layer moe-tune tests-moe-tp nano-mixtral-tp2
# Writes logs and JSON under $OUT (default ./out/gpu). Wheels in .whl/ (e.g. polars) are
# installed to /tmp/site first when present, for machines without them.
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
stages=${*:-tests kernels nano-qwen}
bench() { python3 -m batchgen bench "$@"; }
for stage in $stages; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case $stage in
    tests) python3 -m pytest -m gpu tests -q -x -p no:warnings 2>&1 | tee "$OUT/gpu_tests.log" ;;
    kernels) python3 tests/kernels/bench_kernels.py 2>&1 | tee "$OUT/kernels.log" ;;
    nano-qwen) bench --workload nano --model-preset qwen3-0.6b --json "$OUT/nano_qwen.json" ;;
    nano-llama) bench --workload nano --model-preset llama3.1-8b --json "$OUT/nano_llama.json" ;;
    shared-prefix) bench --workload shared-prefix --model-preset llama3.1-8b \
      --json "$OUT/shared_prefix.json" ;;
    summarize) bench --workload summarize --model-preset llama3.1-8b --json "$OUT/summarize.json" ;;
    score) bench --workload score --model-preset llama3.1-8b --json "$OUT/score.json" ;;
    peer-qwen) bench --workload nano --model-preset qwen3-0.6b --peer hf \
      --json "$OUT/nano_qwen_peer.json" ;;
    peer-llama) bench --workload nano --model-preset llama3.1-8b --peer hf \
      --json "$OUT/nano_llama_peer.json" ;;
    profile-qwen) python3 examples/benchmarks/profile_decode.py qwen3-0.6b 30 \
      2>&1 | tee "$OUT/profile_qwen.log" ;;
    profile-llama) python3 examples/benchmarks/profile_decode.py llama3.1-8b 20 \
      2>&1 | tee "$OUT/profile_llama.log" ;;
    profile-qwen-small) python3 examples/benchmarks/profile_decode.py qwen3-0.6b 30 4 \
      2>&1 | tee "$OUT/profile_qwen_small.log" ;;
    placement) python3 tests/kernels/bench_kernels.py --only placement \
      2>&1 | tee "$OUT/placement.log" ;;
    decode-tune) python3 tests/kernels/bench_kernels.py --only decode --tune \
      2>&1 | tee "$OUT/decode_tune.log" ;;
    nano-qwen3) bench --workload nano --model-preset qwen3-0.6b --repeat 3 \
      --json "$OUT/nano_qwen_r3.json" ;;
    nano-llama3) bench --workload nano --model-preset llama3.1-8b --repeat 3 \
      --json "$OUT/nano_llama_r3.json" ;;
    run-qwen) python3 examples/benchmarks/profile_run.py qwen3-0.6b \
      2>&1 | tee "$OUT/run_qwen.log" ;;
    run-llama) python3 examples/benchmarks/profile_run.py llama3.1-8b \
      2>&1 | tee "$OUT/run_llama.log" ;;
    timeline-qwen) python3 examples/benchmarks/step_timeline.py qwen3-0.6b async sync \
      2>&1 | tee "$OUT/timeline_qwen.log" ;;
    jit-qwen) python3 examples/benchmarks/jit_misses.py qwen3-0.6b 2>&1 | tee "$OUT/jit_qwen.log" ;;
    tests-moe) python3 -m pytest -m gpu tests/gpu/test_moe_gpu.py tests/kernels/test_fused_moe.py \
      tests/kernels/test_moe_align.py tests/kernels/test_moe_router.py -q -p no:warnings \
      2>&1 | tee "$OUT/gpu_tests_moe.log" ;;
    nano-moe) bench --workload nano --model-preset qwen3-30b-a3b --repeat 3 \
      --json "$OUT/nano_moe.json" ;;
    jit-moe) python3 examples/benchmarks/jit_misses.py qwen3-30b-a3b 2>&1 | tee "$OUT/jit_moe.log" ;;
    moe-layer) python3 -m batchgen.bench.moe_layer --preset qwen3-30b-a3b \
      --json "$OUT/moe_layer.json" 2>&1 | tee "$OUT/moe_layer.log" ;;
    moe-tune) python3 -m batchgen.bench.moe_tune --shape qwen3-30b-a3b \
      --tokens 1 4 16 64 128 256 384 512 --json "$OUT/moe_tune.json" 2>&1 | tee "$OUT/moe_tune.log" ;;
    tests-moe-tp) python3 -m pytest -m gpu tests/gpu/test_moe_tp_gpu.py -q -p no:warnings -s \
      2>&1 | tee "$OUT/gpu_tests_moe_tp.log" ;;
    nano-mixtral-tp2) bench --workload nano --model-preset mixtral-8x7b --tensor-parallel-size 2 \
      --json "$OUT/nano_mixtral_tp2.json" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
