"""Compile every Triton kernel for an H100 (sm_90) on a machine without a GPU.

The interpreter does not check what the GPU compiler rejects (tl.dot operands under 16, layout
or shared-memory limits), so the kernels are lowered to PTX and assembled with the ptxas that
ships in the triton wheel. Runs in a child process: the kernels must be decorated without
TRITON_INTERPRET. Pointer and stride arguments carry the 16-divisibility hints a real launch
would add, so the compiled code is the pipelined code a GPU would run.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOT_ALIGNED = {"stride_bt", "stride_lse_t", "stride_lse_h", "num_splits", "scale_log2e", "eps"}


def _compile(fn, pointers: dict[str, str], constexprs: dict, floats=(), **options) -> int:
    """Lower fn for sm_90; returns the shared memory it needs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "i32" for name in fn.arg_names}
    signature.update(pointers)
    signature.update({name: "fp32" for name in floats})
    signature.update({name: "constexpr" for name in constexprs})
    attrs = {
        (fn.arg_names.index(name),): [["tt.divisibility", 16]]
        for name, ty in signature.items()
        if name not in NOT_ALIGNED and (ty.startswith("*") or ty == "i32")
    }
    consts = {(fn.arg_names.index(name),): value for name, value in constexprs.items()}
    source = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert kernel.asm["cubin"], "no cubin"
    return kernel.metadata.shared


def _attention(dtype: str, head_dim: int, group: int, max_query_len: int, split: bool) -> int:
    import torch

    from kernels import attention

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    config = attention.launch_config(torch_dtype, 2 * group, 2, head_dim, max_query_len)
    options = {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages")}
    pointers = {name: "*" + dtype for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr")}
    for name in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"):
        pointers[name] = "*i32"
    pointers.update(out_ptr="*fp32" if split else "*" + dtype, lse_ptr="*fp32")
    constexprs = dict(config, KV_BLOCK_SIZE=16, SPLIT=split)
    return _compile(
        attention._paged_attention_kernel, pointers, constexprs, floats=["scale_log2e"], **options
    )


def main() -> None:
    from kernels import activation, attention_reduce, kv_cache, norm, rope

    # The launcher's configurations: decode with splits, 8B prefill, GQA-7 head_dim 64, fp32.
    for config in [("bf16", 128, 4, 1, True), ("bf16", 128, 4, 2048, False),
                   ("fp16", 64, 7, 512, False), ("bf16", 80, 1, 1, True), ("fp32", 128, 8, 100, False)]:  # fmt: skip
        shared = _attention(*config)
        assert shared <= 227 * 1024, f"{config} needs {shared} bytes of shared memory"
    dt = "*bf16"
    names = ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")
    _compile(kv_cache._store_kv_kernel, {**dict.fromkeys(names, dt), "slot_mapping_ptr": "*i64"},
             dict(BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128))  # fmt: skip
    names = ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "new_residual_ptr")
    _compile(norm._rms_norm_kernel, dict.fromkeys(names, dt), dict(HAS_RESIDUAL=True, BLOCK=4096),
             floats=["eps"], num_warps=16)  # fmt: skip
    _compile(rope._rotary_kernel,
             {"positions_ptr": "*i64", "q_ptr": dt, "k_ptr": dt, "cos_sin_ptr": "*fp32"},
             dict(BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64))  # fmt: skip
    _compile(activation._silu_and_mul_kernel, {"x_ptr": dt, "out_ptr": dt}, dict(BLOCK=1024))
    _compile(attention_reduce._merge_splits_kernel,
             {"partial_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": dt},
             dict(HEAD_DIM=128, HEAD_DIM_PAD=128, SPLITS_PAD=64))  # fmt: skip
    print("compiled")


def test_kernels_compile_for_sm90():
    triton = pytest.importorskip("triton")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton build ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-4000:]


if __name__ == "__main__":
    main()
