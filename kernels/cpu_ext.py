"""The fused CPU kernels of kernels/csrc/: built on first use, loaded as torch.ops.

    from kernels import cpu_ext
    ops = cpu_ext.load()  # torch.ops.folio_cpu, or None where it cannot be built

The extension is compiled with torch.utils.cpp_extension (gcc or clang, and ninja: the `ninja`
package is a dependency) for the vector ISA torch itself dispatches to (AVX512, AVX2 or none),
into ``$FOLIO_CPU_EXT_DIR`` or ``$FOLIO_CACHE_DIR/cpu-ext`` (default
``~/.cache/folio/cpu-ext``); the directory name carries the ISA and a hash of the sources, the
flags and the torch version, so a changed source or another ISA builds anew and a cached build
loads in milliseconds. `make install` builds it once (`python -m kernels.cpu_ext`), so the
first server start does not. The build answers ``isa()`` and ``vector_width()`` (its fp32
lanes) itself.

Forcing a narrower ISA: torch's own ``ATEN_CPU_CAPABILITY=avx2`` (or ``default``) lowers what
torch dispatches to, and Folio follows it everywhere it depends on the ISA: this extension is
built for it, and `kernels.cpu.has_native_bf16()` says no once torch's ISA is below the CPU's
(`lowered()`), so bf16 models take the fp32 path of CPUs without AVX512-BF16. An AVX-512
machine with ``ATEN_CPU_CAPABILITY=avx2`` thus runs as an AVX2-only one would, oneDNN's own
kernels aside (they pick by cpuid). Child processes inherit the variable.

`FOLIO_CPU_EXT` chooses: ``auto`` (default: use it when it builds, else log why once and run
the torch implementations in kernels/cpu/), ``0`` (never: the torch implementations only),
``1`` (required: a failed build raises).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import structlog
import torch

log = structlog.get_logger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))  # ops.cpp registers the ops the others define
MODE = os.environ.get("FOLIO_CPU_EXT", "auto")
if MODE not in ("auto", "0", "1"):
    raise ValueError(f"FOLIO_CPU_EXT must be auto, 0 or 1, not {MODE!r}")

# Per torch's own dispatch level: the macros ATen's vector headers select on, and the ISA flags.
_ISA_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw",
               "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}
_DEFAULT_FLAGS = ["-DCPU_CAPABILITY=DEFAULT"]
# No FMA contraction: fp32 rotary must round exactly where the twin does. OpenMP: at::parallel_for
# is inline and runs on the OpenMP runtime torch already loaded (same soname, libgomp.so.1).
_COMMON_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]


_ISA_ORDER = ["DEFAULT", "AVX2", "AVX512"]  # each runs wherever a later one does


def capability() -> str:
    """The vector ISA torch dispatches to (ATEN_CPU_CAPABILITY may lower it): AVX512, AVX2, or
    DEFAULT. The extension is built for this one."""
    cap = torch.backends.cpu.get_cpu_capability()
    return cap if cap in _ISA_FLAGS else "DEFAULT"


def cpu_capability() -> str:
    """The widest of those this CPU runs (torch's own test, from cpuid), whatever is forced."""
    if torch.cpu._is_avx512_supported():
        return "AVX512"
    return "AVX2" if torch.cpu._is_avx2_supported() else "DEFAULT"


def lowered() -> bool:
    """Whether torch dispatches to a narrower ISA than this CPU's (ATEN_CPU_CAPABILITY)."""
    return _ISA_ORDER.index(capability()) < _ISA_ORDER.index(cpu_capability())


def build_flags() -> list[str]:
    return _COMMON_FLAGS + _ISA_FLAGS.get(capability(), _DEFAULT_FLAGS)


def build_dir() -> Path:
    """$FOLIO_CPU_EXT_DIR, else $FOLIO_CACHE_DIR/cpu-ext (default ~/.cache/folio/cpu-ext)."""
    if os.environ.get("FOLIO_CPU_EXT_DIR"):
        return Path(os.environ["FOLIO_CPU_EXT_DIR"])
    root = Path(os.environ.get("FOLIO_CACHE_DIR", Path.home() / ".cache" / "folio"))
    return root / "cpu-ext"


def is_built() -> bool:
    """Whether this ISA's build of the current sources is in the cache (loads in milliseconds)."""
    name = _name(build_flags())
    return (build_dir() / name / f"{name}.so").exists()


def describe() -> str:
    """One line on the ISA: the CPU's, torch's (and whether forced), the extension's build (the
    build's own answer when it is cached or loaded; this never compiles)."""
    forced = ""
    if lowered():
        env = os.environ.get("ATEN_CPU_CAPABILITY")
        forced = f", forced by ATEN_CPU_CAPABILITY={env}" if env else ", lowered"
    if MODE == "0":
        ext = "off (FOLIO_CPU_EXT=0)"
    elif load.cache_info().currsize or is_built():
        ops = load()
        ext = f"{ops.isa()} build, {ops.vector_width()} fp32 lanes" if ops else "unavailable"
    else:
        ext = f"not built yet (would build for {capability()})"
    return f"cpu {cpu_capability()}, torch dispatches {capability()}{forced}; fused kernels: {ext}"


def _name(flags: list[str]) -> str:
    key = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):  # the .cpp sources and their header
        key.update(path.name.encode())
        key.update(path.read_bytes())
    key.update(" ".join(flags).encode())
    key.update(torch.__version__.encode())
    key.update(sys.version.encode())
    return f"folio_cpu_{capability().lower()}_{key.hexdigest()[:12]}"


def _ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the pip package's binary may not be there."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR


def build(verbose: bool = False) -> Path:
    """Compile (or find the cached build of) the extension and load it; returns the .so path."""
    from torch.utils import cpp_extension

    flags = build_flags()
    name = _name(flags)
    directory = build_dir() / name
    directory.mkdir(parents=True, exist_ok=True)
    _ninja_on_path()
    started = time.monotonic()
    cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=flags,
                       extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False,
                       verbose=verbose)
    seconds = time.monotonic() - started
    if seconds > 1.0:
        log.info("cpu kernels built", name=name, seconds=round(seconds, 1))
    return directory / f"{name}.so"


@functools.cache
def load() -> SimpleNamespace | None:
    """torch.ops.folio_cpu once the extension is loaded; None when FOLIO_CPU_EXT=0 or (auto)
    the build failed."""
    if MODE == "0":
        return None
    try:
        build()
    except Exception as e:  # a missing compiler, headers or ninja: the torch path still runs
        if MODE == "1":
            raise RuntimeError(f"FOLIO_CPU_EXT=1 but the CPU kernels did not build: {e}") from e
        log.warning("cpu kernels unavailable, using the torch implementations",
                    reason=f"{type(e).__name__}: {str(e)[-500:]}")
        return None
    return torch.ops.folio_cpu


def available() -> bool:
    return load() is not None


if __name__ == "__main__":  # `python -m kernels.cpu_ext`: build now (make install does)
    path = build(verbose="-v" in sys.argv)
    print(path)
    print(describe())
