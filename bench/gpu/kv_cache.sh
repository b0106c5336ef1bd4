#!/bin/bash
# Run on a lent GPU machine from the repository root with the wheels of ../shared/gpu/fetch-wheels.sh
# (plus llguidance, smg-grpc-proto, grpcio-tools) in .whl: results land in $OUT.
# The quantized KV cache (--kv-cache-dtype fp8/int8) and the prefix cache's host tier on CUDA, in
# two time boxes (under 6 minutes with the defaults):
#   KERNEL_S (200 s): tests/kernels/test_kv_quant_gpu.py, the Triton store_kv and attention
#     launches over fp8/int8 caches (fp32/bf16/fp16 queries; most of the time is Triton compiles);
#   EXEC_S (150 s): CUDA-graph decode over fp8/int8 caches against eager, the pinned host tier
#     and its side-stream copies, the pinned swap pool.
# With LAT set (e.g. LAT="auto fp8 int8", RUN_S = 75 s each) it then runs folio bench latency of
# the random Qwen2.5-0.5B per --kv-cache-dtype (bf16, batch 1, CUDA graphs).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FOLIO_CACHE_DIR=/tmp/folio-cache
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c "import torch,triton,sys;print('torch',torch.__version__,'triton',triton.__version__,'python',sys.version.split()[0])";
  echo "commit $(cat .gpurun/commit 2>/dev/null || git rev-parse HEAD)"; } > $OUT/device.txt 2>&1
timeout ${KERNEL_S:-200} python3 -m pytest -m gpu -q -p no:cacheprovider -rs --durations=10 \
  tests/kernels/test_kv_quant_gpu.py > $OUT/kv-kernel-tests.log 2>&1
echo "pytest rc $?" >> $OUT/kv-kernel-tests.log
timeout ${EXEC_S:-150} python3 -m pytest -m gpu -q -p no:cacheprovider -rs --durations=10 \
  tests/executor/step/test_graph_runner_gpu.py tests/executor/kv/test_host_tier_gpu.py \
  tests/executor/step/test_cuda_paths.py > $OUT/kv-executor-tests.log 2>&1
echo "pytest rc $?" >> $OUT/kv-executor-tests.log
cat $OUT/device.txt; tail -15 $OUT/kv-kernel-tests.log; tail -15 $OUT/kv-executor-tests.log
mkdir -p /tmp/res
for kv in ${LAT:-}; do
  timeout ${RUN_S:-75} python3 -m client.cli bench latency --random-model qwen2.5-0.5b \
    --dtype bfloat16 --batch-size 1 --input-len 128 --output-len 64 --reps 3 --peers folio \
    --max-num-seqs 32 --kv-cache-gib 8 --serve-arg=--kv-cache-dtype=$kv --out /tmp/res \
    --name h200-latency-qwen0.5b-bf16-b1-kv-$kv > /tmp/res/log-$kv.txt 2>&1
  echo "$kv rc $?"; grep -E "TPOT p50|output tok/s" /tmp/res/*b1-kv-$kv.md 2>/dev/null
  tail -c 300 /tmp/res/log-$kv.txt | tr '\r' '\n' | tail -2
done
cp /tmp/res/*.md /tmp/res/*.json /tmp/res/log-* $OUT/ 2>/dev/null; ls $OUT
