#!/bin/bash
# Run on a lent GPU machine from the repository root with the wheels of ../shared/gpu/fetch-wheels.sh
# (plus llguidance, smg-grpc-proto, grpcio-tools) in .whl: results land in $OUT.
# Quantization on the GPU: the gpu-marked quantized-kernel tests (TESTS=1), the quantized-linear
# benchmark (after a SWEEP_S-second sweep of decode launch configurations when SWEEP_S > 0),
# and folio bench latency (batch 1, CUDA graphs) for each weight format in LAT
# (none, int8, fp8, gptq: a 4-bit group-128 RTN checkpoint of the same random model, after none).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FOLIO_CACHE_DIR=/tmp/folio-cache
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c "import torch,triton,sys;print('torch',torch.__version__,'triton',triton.__version__,'python',sys.version.split()[0])";
  echo "commit $(git rev-parse HEAD 2>/dev/null)"; } > $OUT/device.txt 2>&1
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_S:-150} python3 -m pytest -m gpu -q -p no:cacheprovider -rs \
    tests/kernels/test_quant_kernels_gpu.py > $OUT/gpu-tests.log 2>&1
  echo "pytest rc $?" >> $OUT/gpu-tests.log; tail -3 $OUT/gpu-tests.log
fi
sweep=(); [ "${SWEEP_S:-0}" != 0 ] && sweep=(--sweep $SWEEP_S)
timeout $(( ${SWEEP_S:-0} + ${BENCH_S:-90} )) python3 -m bench.quant_kernels --out /tmp/qk "${sweep[@]}" > /tmp/qk.log 2>&1
echo "quant bench rc $?"; cp /tmp/qk/quant-* $OUT/ 2>/dev/null
grep -E "^\| [0-9]" /tmp/qk/quant-kernels.md | awk -F'|' '$3+0 != 16' | cut -c1-110
mkdir -p /tmp/res
src=/tmp/folio-cache/bench-models/qwen2.5-0.5b-random-seed0-v1
for q in ${LAT:-}; do
  model=(--random-model qwen2.5-0.5b); extra=()
  case $q in
    int8|fp8) extra=(--serve-arg=--quantization=$q) ;;
    gptq) [ -d $src ] || { echo "gptq: run 'none' first (it writes $src)"; continue; }
          timeout 120 python3 -m bench.rtn_checkpoint --format gptq --group-size 128 --src $src \
            --out /tmp/qwen-gptq > /tmp/res/rtn.log 2>&1 || { echo "rtn rc $?"; tail -3 /tmp/res/rtn.log; continue; }
          model=(--model /tmp/qwen-gptq) ;;
  esac
  timeout ${RUN_S:-75} python3 -m client.cli bench latency "${model[@]}" \
    --dtype bfloat16 --batch-size 1 --input-len 128 --output-len 64 --reps 3 --peers folio \
    --max-num-seqs 32 --kv-cache-gib 8 "${extra[@]}" --out /tmp/res \
    --name h200-latency-qwen0.5b-bf16-b1-$q > /tmp/res/log-$q.txt 2>&1
  echo "$q rc $?"; grep -E "TPOT p50|output tok/s" /tmp/res/*b1-$q.md 2>/dev/null
  tail -c 300 /tmp/res/log-$q.txt | tr '\r' '\n' | tail -2
  cp /tmp/res/*.md /tmp/res/*.json $OUT/ 2>/dev/null
done
cp /tmp/res/*.md /tmp/res/*.json $OUT/ 2>/dev/null; ls $OUT
