#!/usr/bin/env bash
# Build llama.cpp's `llama-server` as a benchmark peer for `folio bench --peers llamacpp`.
#
#   bench/install_llama_cpp.sh [PREFIX]      (default: .llama-cpp at the repository root)
#
# Leaves PREFIX/bin/llama-server and PREFIX/VERSION (the llama.cpp commit, the build flags and
# the CPU it was built for). llama.cpp is never a dependency of Folio: only the benchmark runs it.
#
# Where the sources come from: only package registries are reachable here, and no PyPI wheel
# ships a plain llama-server binary, so it is built from the llama.cpp tree that the
# llama-cpp-python sdist vendors (pinned below, with the llama.cpp commit it must contain).
# cmake and ninja are pinned wheels in a build venv under PREFIX. Only the llama-server target
# is built: Release, static libraries, GGML_NATIVE=ON (the ISA of this CPU: AVX-512, AMX... as
# found), without the web UI (its assets would be downloaded) and without OpenSSL.
#
# The build runs under `nice -n 19` with 2 jobs (override: JOBS=N): it shares the machine.
# Idempotent: a finished build leaves a stamp holding the CPU's flags; a second run on the same
# CPU checks `llama-server --version` and stops there. A different CPU (GGML_NATIVE code may not
# run on it) or a different pin rebuilds. Delete PREFIX to start over.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="${1:-$REPO_ROOT/.llama-cpp}"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
LLAMA_CPP_PYTHON_VERSION="0.3.36"
LLAMA_CPP_PYTHON_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP_COMMIT="0c1e57098bba43ac29e6e3b677cdceebdd22334f"
CMAKE_SPEC="cmake==4.4.4"
NINJA_SPEC="ninja==1.13.2"

BIN="$PREFIX/bin/llama-server"
STAMP="$PREFIX/.folio-bench-llama-cpp-installed"
cpu_key() {
  # What GGML_NATIVE compiled for: the CPU model and its flags.
  { grep -m1 '^model name' /proc/cpuinfo || true; grep -m1 '^flags' /proc/cpuinfo || true; } \
    | sha256sum | cut -d' ' -f1
}
WANT="llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION $LLAMA_CPP_COMMIT $(cpu_key)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && "$BIN" --version >/dev/null 2>&1; then
  echo "llama-server already built: $BIN"
  "$BIN" --version 2>&1 | head -2
  exit 0
fi

start=$(date +%s)
mkdir -p "$PREFIX/bin"
rm -f "$STAMP"

TOOLS="$PREFIX/build-venv"
if [[ ! -x "$TOOLS/bin/python" ]]; then
  "$PYTHON" -m venv "$TOOLS"
fi
"$TOOLS/bin/python" -m pip install -q "$CMAKE_SPEC" "$NINJA_SPEC"
CMAKE="$TOOLS/bin/cmake"
export PATH="$TOOLS/bin:$PATH"  # cmake finds the pinned ninja

SRC_PARENT="$PREFIX/src"
SRC="$SRC_PARENT/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
SDIST="$SRC_PARENT/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
if [[ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
  mkdir -p "$SRC_PARENT"
  if [[ ! -f "$SDIST" ]]; then
    # The sdist only (--no-binary for this package alone: its build requirements come as
    # wheels while pip prepares its metadata; `:all:` would compile cmake from source).
    "$TOOLS/bin/python" -m pip download -q --no-deps --no-binary llama-cpp-python \
      -d "$SRC_PARENT" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
  fi
  echo "$LLAMA_CPP_PYTHON_SHA256  $SDIST" | sha256sum -c --quiet
  tar -xzf "$SDIST" -C "$SRC_PARENT"
fi
LLAMA_SRC="$SRC/vendor/llama.cpp"
got_commit="$(cat "$SRC/.git/modules/vendor/llama.cpp/HEAD" 2>/dev/null || echo unknown)"
if [[ "$got_commit" != "$LLAMA_CPP_COMMIT" ]]; then
  echo "install_llama_cpp.sh: llama-cpp-python $LLAMA_CPP_PYTHON_VERSION vendors llama.cpp" \
    "$got_commit, expected $LLAMA_CPP_COMMIT" >&2
  exit 1
fi

BUILD="$PREFIX/build"
# -march=native objects of another CPU are not rebuilt by ninja (same command line): start over.
if [[ -d "$BUILD" && "$(cat "$BUILD/.folio-cpu-key" 2>/dev/null)" != "$(cpu_key)" ]]; then
  rm -rf "$BUILD"
fi
mkdir -p "$BUILD"
cpu_key >"$BUILD/.folio-cpu-key"
CMAKE_FLAGS=(
  -G Ninja
  -DCMAKE_BUILD_TYPE=Release
  -DGGML_NATIVE=ON
  -DBUILD_SHARED_LIBS=OFF
  -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_SERVER=ON
  -DLLAMA_BUILD_UI=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_COMMIT="${LLAMA_CPP_COMMIT:0:12}"
)
"$CMAKE" -S "$LLAMA_SRC" -B "$BUILD" "${CMAKE_FLAGS[@]}" >"$PREFIX/cmake-configure.log"
nice -n 19 "$CMAKE" --build "$BUILD" --target llama-server -j "$JOBS" >"$PREFIX/cmake-build.log"
install -m 755 "$BUILD/bin/llama-server" "$BIN"

"$BIN" --version >/dev/null 2>&1
elapsed=$(( $(date +%s) - start ))
{
  echo "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (sdist, vendored llama.cpp)"
  echo "llama.cpp commit $LLAMA_CPP_COMMIT"
  echo "commit date $(git -C "$LLAMA_SRC" log -1 --format=%cI 2>/dev/null || echo unknown)"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) in ${elapsed} s with $JOBS jobs"
  echo "cmake flags ${CMAKE_FLAGS[*]}"
  echo "compiler $(c++ --version 2>/dev/null | head -1)"
  echo "cpu $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
} >"$PREFIX/VERSION"
echo "$WANT" >"$STAMP"
echo "llama-server built in $elapsed s: $BIN"
"$BIN" --version 2>&1 | head -2
