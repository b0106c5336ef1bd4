"""The ISA switch (ATEN_CPU_CAPABILITY, kernels/cpu_ext.py) and the fused kernels' narrower
paths on a machine that could run wider ones.

On an AVX-512 CPU the tests of kernels/csrc run again in a child with ATEN_CPU_CAPABILITY=avx2:
the AVX2 build of the extension (built once into the shared cache: ~35 s on 2 cores, then
cached by its flags), every AVX2 kernel path against the same oracles (~10 s).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_ext

ROOT = Path(__file__).resolve().parents[2]
# Every test that runs a kernel of kernels/csrc.
FUSED_KERNEL_TESTS = ["tests/kernels/test_cpu_ext.py", "tests/kernels/test_cpu_kernels.py",
                      "tests/kernels/test_skinny_linear.py",
                      "tests/kernels/test_skinny_linear_quant.py",
                      "tests/kernels/test_fused_moe.py", "tests/kernels/test_kv_quant.py"]
# Together under pytest's 600 s, so a hung child reports its own output.
BUILD_TIMEOUT_S, TESTS_TIMEOUT_S = 300, 240


def _avx2_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "PYTHONPATH": str(ROOT), **extra}


@pytest.mark.skipif(cpu_ext.cpu_capability() != "AVX512",
                    reason="this CPU runs nothing wider than AVX2: nothing to force lower")
def test_forcing_avx2_lowers_torch_the_build_and_native_bf16():
    code = ("from kernels import cpu, cpu_ext\n"
            "print(cpu_ext.cpu_capability(), cpu_ext.capability(), cpu_ext.lowered(),"
            " cpu.has_native_bf16(), cpu_ext._name(cpu_ext.build_flags()))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=_avx2_env())
    assert done.returncode == 0, done.stderr[-2000:]
    cpu_isa, torch_isa, lowered, native_bf16, name = done.stdout.split()
    assert (cpu_isa, torch_isa, lowered, native_bf16) == ("AVX512", "AVX2", "True", "False")
    # Its own build directory: the AVX-512 build stays cached beside it.
    assert name.startswith("folio_cpu_avx2_")
    assert name != cpu_ext._name(cpu_ext.build_flags()) or cpu_ext.capability() == "AVX2"


@pytest.mark.skipif(cpu_ext.capability() != "AVX512",
                    reason=f"torch dispatches {cpu_ext.capability()} here (CPU "
                    f"{cpu_ext.cpu_capability()}): only an AVX-512 run reruns them narrower")
@pytest.mark.skipif(cpu_ext.MODE == "0", reason="FOLIO_CPU_EXT=0: the fused kernels are off")
def test_fused_kernel_tests_pass_with_avx2_forced():
    if cpu_ext.load() is None:
        pytest.skip("the fused CPU kernels did not build here")
    # FOLIO_CPU_EXT=1: a failed AVX2 build fails the child rather than skipping its tests.
    env = _avx2_env(FOLIO_CPU_EXT="1", FOLIO_CPU_EXT_DIR=str(cpu_ext.build_dir()))
    built = subprocess.run([sys.executable, "-m", "kernels.cpu_ext"], cwd=ROOT,
                           capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env=env)
    assert built.returncode == 0, built.stderr[-4000:]
    # The build's own answer: compiled for AVX2, 8 fp32 lanes.
    assert "forced by ATEN_CPU_CAPABILITY=avx2; fused kernels: AVX2 build, 8 fp32 lanes" \
        in built.stdout, built.stdout
    # --verbosity=0 whatever PYTEST_ADDOPTS says: the header line shows.
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "--verbosity=0", *FUSED_KERNEL_TESTS], cwd=ROOT, capture_output=True,
                          text=True, timeout=TESTS_TIMEOUT_S, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    # tests/conftest.py's header: the tests ran on that build.
    assert "fused kernels: AVX2 build, 8 fp32 lanes" in output, output[:3000]
