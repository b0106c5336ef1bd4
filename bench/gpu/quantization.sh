#!/bin/bash
# Run on a lent GPU machine from the repository root with the wheels of ../shared/gpu/fetch-wheels.sh
# (plus llguidance, smg-grpc-proto, grpcio-tools) in .whl: results land in $OUT.
# Quantization on the GPU: the gpu-marked kernel tests, the quantized-linear benchmark, and
# folio bench latency (batch 1, CUDA graphs) with 16-bit, int8 and fp8 weights.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FOLIO_CACHE_DIR=/tmp/folio-cache
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c "import torch,triton,sys;print('torch',torch.__version__,'triton',triton.__version__,'python',sys.version.split()[0])";
  echo "commit $(git rev-parse HEAD 2>/dev/null)"; } > $OUT/device.txt 2>&1
timeout ${TEST_S:-170} python3 -m pytest -m gpu -q -p no:cacheprovider -rs \
  tests/kernels/test_quant_kernels_gpu.py tests/kernels/test_kernels_gpu.py tests/executor/test_cuda_paths.py \
  > $OUT/gpu-tests.log 2>&1
echo "pytest rc $?" >> $OUT/gpu-tests.log; tail -4 $OUT/gpu-tests.log
timeout ${BENCH_S:-120} python3 -m bench.quant_kernels --out $OUT > $OUT/quant-kernels.log 2>&1
echo "quant bench rc $?" | tee -a $OUT/quant-kernels.log
mkdir -p /tmp/res
for q in none int8 fp8; do
  extra=(); [ $q != none ] && extra=(--serve-arg=--quantization=$q)
  timeout ${RUN_S:-75} python3 -m client.cli bench latency --random-model qwen2.5-0.5b \
    --dtype bfloat16 --batch-size 1 --input-len 128 --output-len 64 --reps 3 --peers folio \
    --max-num-seqs 32 --kv-cache-gib 8 "${extra[@]}" --out /tmp/res \
    --name h200-latency-qwen0.5b-bf16-b1-$q > /tmp/res/log-$q.txt 2>&1
  echo "$q rc $?"; grep -E "TPOT p50|output tok/s" /tmp/res/*b1-$q.md 2>/dev/null
  tail -c 400 /tmp/res/log-$q.txt | tr '\r' '\n' | tail -3
done
cp /tmp/res/*.md /tmp/res/*.json $OUT/ 2>/dev/null; ls $OUT
