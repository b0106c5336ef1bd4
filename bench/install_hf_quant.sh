#!/usr/bin/env bash
# Install GPTQModel (with optimum) into its own venv, so that HF transformers can load GPTQ and
# AWQ checkpoints on the CPU: the oracle (bench/hf_quant_oracle.py) for Folio's 4-bit loaders.
#
#   bench/install_hf_quant.sh [VENV_DIR]      (default: .venv-hf-quant at the repository root)
#
# Never a dependency of Folio: GPTQModel pulls numpy, datasets, torchao and friends at versions
# of its own. transformers 5.24 loads GPTQ through optimum + gptqmodel and AWQ through gptqmodel
# (+ accelerate); gptqmodel 7.7 needs torch >= 2.14.1, so 7.6 is the newest that installs beside
# Folio's CPU torch pin. BUILD_CUDA_EXT=0 builds it without CUDA extensions (its torch kernels
# run on the CPU), and --no-build-isolation lets its setup see the installed torch.
#
# Idempotent: a finished install leaves a stamp file; a second run checks the import and stops
# there. Delete VENV_DIR to start over.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="${1:-$REPO_ROOT/.venv-hf-quant}"
PYTHON="${PYTHON:-python3.11}"
STAMP="$VENV_DIR/.folio-hf-quant-installed"
PY="$VENV_DIR/bin/python"
C="$REPO_ROOT/constraints-cpu.txt"

check_import() {
  # -I: the current folder (Folio's root has a `kernels` package) must not shadow the venv's.
  "$PY" -I -c 'import gptqmodel, optimum.gptq, transformers, torch; print("gptqmodel",
gptqmodel.__version__, "transformers", transformers.__version__, "torch", torch.__version__)'
}

if [[ -f "$STAMP" ]] && check_import; then
  echo "HF quantization oracle already installed in $VENV_DIR"
  exit 0
fi
if [[ ! -x "$PY" ]]; then
  "$PYTHON" -m venv "$VENV_DIR"
fi
"$PY" -m pip install -q --upgrade pip setuptools wheel
"$PY" -m pip install -q -c "$C" torch==2.13.0+cpu
"$PY" -m pip install -q -c "$C" transformers==5.24.0 safetensors==0.8.0 accelerate==1.15.0 \
  tokenizers==0.23.3 optimum==2.3.0
BUILD_CUDA_EXT=0 "$PY" -m pip install -q -c "$C" --no-build-isolation gptqmodel==7.6.0
check_import
touch "$STAMP"
