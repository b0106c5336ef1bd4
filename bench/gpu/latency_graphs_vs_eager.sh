#!/bin/bash
# Run on a lent GPU machine from the repository root with the wheels of ../shared/gpu/fetch-wheels.sh
# (plus llguidance, smg-grpc-proto, grpcio-tools) in .whl: results land in $OUT.
# folio bench latency on the GPU: decode graphs against --enforce-eager, batch 1 and 16.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FOLIO_CACHE_DIR=/tmp/folio-cache
mkdir -p /tmp/res
for bs in 1 16; do
  for mode in graphs eager; do
    extra=(); [ $mode = eager ] && extra=(--serve-arg=--enforce-eager)
    timeout ${RUN_S:-100} python3 -m client.cli bench latency --random-model qwen2.5-0.5b \
      --dtype bfloat16 --batch-size $bs --input-len 128 --output-len 64 --reps 3 --peers folio \
      --max-num-seqs 32 --kv-cache-gib 8 "${extra[@]}" --out /tmp/res \
      --name h200-latency-qwen0.5b-bf16-b$bs-$mode > /tmp/res/log-$bs-$mode.txt 2>&1
    echo "b$bs $mode rc $?"; grep -E "TTFT p50|TPOT p50|output tok/s" /tmp/res/*b$bs-$mode.md 2>/dev/null
    tail -c 600 /tmp/res/log-$bs-$mode.txt | tr '\r' '\n' | tail -4
  done
done
cp /tmp/res/*.md /tmp/res/*.json $OUT/ 2>/dev/null; ls $OUT
