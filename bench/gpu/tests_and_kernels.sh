#!/bin/bash
# Run on a lent GPU machine from the repository root with the wheels of ../shared/gpu/fetch-wheels.sh
# (plus llguidance, smg-grpc-proto, grpcio-tools) in .whl: results land in $OUT.
# One device run: the gpu-marked tests, then the kernel benchmark (quick), into $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c "import torch,triton,sys;print('torch',torch.__version__,'triton',triton.__version__,'python',sys.version.split()[0])";
  echo "commit $(cat .gpurun/commit 2>/dev/null || git rev-parse HEAD)"; } > $OUT/device.txt 2>&1
timeout ${TEST_S:-270} python3 -m pytest -m gpu -q -p no:cacheprovider -rs \
  tests/kernels/test_kernels_gpu.py tests/kernels/test_quant_kernels_gpu.py tests/executor/step/test_cuda_paths.py \
  tests/executor/step/test_graph_runner_gpu.py > $OUT/gpu-tests.log 2>&1
echo "pytest rc $?" >> $OUT/gpu-tests.log
timeout ${BENCH_S:-200} python3 -m bench.kernels --out $OUT --quick > $OUT/bench.log 2>&1
echo "bench rc $?" >> $OUT/bench.log
cat $OUT/device.txt; tail -25 $OUT/gpu-tests.log; tail -25 $OUT/bench.log
