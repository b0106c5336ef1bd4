"""Compile every Triton kernel for an H100 (sm_90) on a machine without a GPU.

The interpreter does not check what the GPU compiler rejects (tl.dot operands under 16, layout
or shared-memory limits), so the kernels are lowered to PTX and assembled with the ptxas that
ships in the triton wheel. Runs in a child process: the kernels must be decorated without
TRITON_INTERPRET. Pointer and stride arguments carry the 16-divisibility hints a real launch
would add (never the per-step ones the kernels exclude with do_not_specialize), so the compiled
code is the code a GPU would run.

The attention kernel's properties are asserted on that code: in every key loop the K and V
tiles sit in shared buffers of >= 2 stages and the loop waits with >= 2 async copy groups still
in flight (the next tile's K and V load while this one is computed on); registers and spills,
from ptxas -v (what Triton's own launch would report), stay within bounds.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
def _compile(fn, pointers: dict[str, str], constexprs: dict, floats=(), **options):
    """Lower fn for sm_90; returns the compiled kernel."""
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
        if (ty.startswith("*") or ty == "i32")
        and not fn.params[fn.arg_names.index(name)].do_not_specialize
    }
    consts = {(fn.arg_names.index(name),): value for name, value in constexprs.items()}
    source = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert kernel.asm["cubin"], "no cubin"
    return kernel


def _registers_and_spills(kernel) -> tuple[int, int]:
    """ptxas -v on the kernel's PTX with the flags Triton uses: (registers, spill bytes)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptx = kernel.asm["ptx"]
    arch = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M).group(1)
    done = subprocess.run([get_ptxas(90).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}",
                           "-", "-o", os.devnull], input=ptx, capture_output=True, text=True,
                          check=True)  # fmt: skip
    regs = int(re.search(r"Used (\d+) registers", done.stderr).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", done.stderr))
    return regs, spills


def _check_pipelined(ttgir: str, config: tuple) -> None:
    """Every key loop keeps >= 2 async copy groups (the next K and V tiles) in flight."""
    loops = ttgir.split("scf.for ")[1:]
    assert len(loops) == 2, f"{config}: expected the unmasked and the masked key loop"
    for body in loops:
        body = body.split("scf.yield")[0]  # the loop body (it holds no nested region)
        waits = [int(n) for n in re.findall(r"ttg\.async_wait[^\n]*\{num = (\d+)", body)]
        copies = body.count("ttg.async_copy_global_to_local")
        assert waits and min(waits) >= 2, f"{config}: the loop waits for every load: {waits}"
        assert copies >= 2, f"{config}: K and V are not loaded asynchronously in the loop"
    # K [HEAD_DIM_PAD, BLOCK_N] and V [BLOCK_N, HEAD_DIM_PAD] tiles in >= 2-stage buffers.
    stages = [int(n) for n in re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x", ttgir)]
    assert len(stages) >= 4 and min(stages) >= 2, f"{config}: K/V buffers of stages {stages}"


def _attention(dtype: str, head_dim: int, group: int, long: bool, split: bool,
               block_size: int = 16, softcap: bool = False, sinks: bool = False,
               kv: str = "") -> int:
    """kv: the cache's element type when quantized ("fp8e4nv", "i8"), else q's."""
    import torch

    from kernels import attention

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    config = attention.launch_config(torch_dtype, 2 * group, 2, head_dim, long)
    short_q = attention.launch_config(torch_dtype, 2 * group, 2, head_dim, False)["BLOCK_Q"]
    options = {"num_warps": config.pop("num_warps"), "num_stages": config["NUM_STAGES"]}
    pointers = {name: "*" + dtype for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    if kv:
        pointers.update(k_cache_ptr="*" + kv, v_cache_ptr="*" + kv)
    pointers.update(k_scale_ptr="*fp32", v_scale_ptr="*fp32")
    for name in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"):
        pointers[name] = "*i32"
    pointers.update(partial_ptr="*fp32", lse_ptr="*fp32", sinks_ptr="*fp32")
    constexprs = dict(config, KV_BLOCK_SIZE=block_size, SHORT_Q=short_q, LONG=long, SPLIT=split,
                      HAS_SOFTCAP=softcap, HAS_SINKS=sinks, KV_QUANT=bool(kv))
    kernel = _compile(attention._paged_attention_kernel, pointers, constexprs,
                      floats=["scale_log2e", "softcap_log2e"], **options)  # fmt: skip
    case = (dtype, head_dim, group, long, split, block_size, softcap, sinks, kv)
    _check_pipelined(kernel.asm["ttgir"], case)
    regs, spills = _registers_and_spills(kernel)
    # Decode tiles (one warp for 16-bit): <= 224 registers keeps 9 programs resident per SM.
    # 16-bit tiles never spill.
    assert regs <= (255 if long else 224), f"{case}: {regs} registers"
    assert dtype == "fp32" or spills == 0, f"{case}: {spills} bytes of spills"
    print(case, f"{regs} registers, {spills} bytes spilled, {kernel.metadata.shared} B shared")
    return kernel.metadata.shared


def main() -> None:
    from kernels import activation, attention_reduce, kv_cache, norm, rope

    # The launcher's configurations: 8B decode (split and not), 8B prefill, GQA-7 head_dim 64
    # (decode with 128-position blocks: one block id per tile), head_dim 80, fp32; the variants
    # (the window is a runtime int, in every compile): softcap and sinks in each launch (sinks
    # in the kernel only without splits; the merge adds them to split rows).
    for config in [("bf16", 128, 4, False, True), ("bf16", 128, 4, False, False),
                   ("bf16", 128, 4, True, False), ("fp16", 64, 7, False, True, 128),
                   ("fp16", 64, 7, True, False), ("bf16", 80, 1, False, True, 32),
                   ("fp32", 128, 8, True, False), ("bf16", 128, 4, False, False, 16, True, True),
                   ("bf16", 128, 4, True, False, 16, True, True),
                   # Quantized caches (kernels/kv_quant.py): fp8 and int8, decode and prefill.
                   ("bf16", 128, 4, False, True, 16, False, False, "fp8e4nv"),
                   ("bf16", 128, 4, True, False, 16, False, False, "fp8e4nv"),
                   ("bf16", 128, 4, False, False, 16, False, False, "i8"),
                   ("fp16", 64, 7, True, False, 16, False, False, "i8")]:  # fmt: skip
        shared = _attention(*config)
        assert shared <= 227 * 1024, f"{config} needs {shared} bytes of shared memory"
    dt = "*bf16"
    names = ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")
    scales = {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    for quant, cache in ((0, dt), (1, "*fp8e4nv"), (2, "*i8")):
        _compile(kv_cache._store_kv_kernel,
                 {**dict.fromkeys(names, dt), "k_cache_ptr": cache, "v_cache_ptr": cache,
                  "slot_mapping_ptr": "*i64", **scales},
                 dict(BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, QUANT=quant))  # fmt: skip
    names = ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "new_residual_ptr")
    _compile(norm._rms_norm_kernel, dict.fromkeys(names, dt), dict(HAS_RESIDUAL=True, BLOCK=4096),
             floats=["eps"], num_warps=16)  # fmt: skip
    _compile(rope._rotary_kernel,
             {"positions_ptr": "*i64", "q_ptr": dt, "k_ptr": dt, "cos_sin_ptr": "*fp32"},
             dict(BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64))  # fmt: skip
    _compile(activation._silu_and_mul_kernel, {"x_ptr": dt, "out_ptr": dt}, dict(BLOCK=1024))
    from kernels import attention

    assert set(attention.PER_STEP_ARGS) <= set(attention._paged_attention_kernel.arg_names)
    for sinks in (False, True):
        _compile(attention_reduce._merge_splits_kernel,
                 {"partial_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": dt, "sinks_ptr": "*fp32"},
                 dict(HEAD_DIM=128, HEAD_DIM_PAD=128, SPLITS_BLOCK=16, HAS_SINKS=sinks))  # fmt: skip
    _quant_linear()
    _group_quant_linear()
    _quant_gemv()
    _fused_moe()
    print("compiled")


def _quant_linear() -> None:
    """w8a16_linear for int8 and e4m3 weights, 16-bit and fp32 activations, at the launcher's
    decode and prefill configurations; 16-bit tiles never spill."""
    import torch

    from kernels import quant_linear

    for weight in ("*i8", "*fp8e4nv"):
        for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16),
                                   ("fp32", torch.float32)):
            for num_tokens in (16, 512):  # tensor-core decode and prefill (1 row: the GEMV)
                config = quant_linear.launch_config(num_tokens, torch_dtype)
                options = {key: config.pop(key) for key in ("num_warps", "num_stages")}
                pointers = {"x_ptr": "*" + dtype, "w_ptr": weight, "scale_ptr": "*fp32",
                            "bias_ptr": "*" + dtype, "out_ptr": "*" + dtype}
                kernel = _compile(quant_linear._w8a16_kernel, pointers,
                                  dict(config, HAS_BIAS=True, IEEE=dtype == "fp32"), **options)
                regs, spills = _registers_and_spills(kernel)
                case = (weight, dtype, num_tokens)
                assert dtype == "fp32" or spills == 0, f"{case}: {spills} bytes of spills"
                print(case, f"{regs} registers, {spills} bytes spilled")


def _group_quant_linear() -> None:
    """group_quant_linear for 4-bit (nibbles, offsets) and 8-bit weights: whole-group K tiles
    (group 128), tiles that gather (act-order g_idx; GGUF-like groups of 32 under 4-bit fp32's
    smallest tile do not), at the decode and prefill configurations; 16-bit tiles never
    spill."""
    import torch

    from kernels import grouped_linear as gq

    for bits, weight in ((4, "*u8"), (8, "*i8")):
        for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16),
                                   ("fp32", torch.float32)):
            for num_tokens, has_gidx, group in ((16, False, 128), (512, False, 128),
                                                (1, True, 128), (16, False, 32), (1, False, 24)):
                g_idx = torch.zeros(1) if has_gidx else None
                config = gq.launch_config(num_tokens, torch_dtype, bits, group, g_idx)
                options = {key: config.pop(key) for key in ("num_warps", "num_stages")}
                pointers = {"x_ptr": "*" + dtype, "w_ptr": weight, "scale_ptr": "*fp32",
                            "offset_ptr": "*fp32", "gidx_ptr": "*i32", "bias_ptr": "*" + dtype,
                            "out_ptr": "*" + dtype}
                constexprs = dict(config, BITS=bits, HAS_OFFSETS=True, HAS_GIDX=has_gidx,
                                  HAS_BIAS=True, IEEE=dtype == "fp32")
                kernel = _compile(gq._group_quant_kernel, pointers, constexprs, **options)
                regs, spills = _registers_and_spills(kernel)
                case = (bits, dtype, num_tokens, has_gidx, group, config["TILE_GROUPS"])
                assert dtype == "fp32" or spills == 0, f"{case}: {spills} bytes of spills"
                print(case, f"{regs} registers, {spills} bytes spilled")


def _quant_gemv() -> None:
    """The decode GEMV (kernels/quant_gemv.py) for every weight kind at its own tile sizes
    (group 128 for the grouped kinds) and 16-bit and fp32 rows; it never spills."""
    from kernels import quant_gemv

    for kind, weight in ((0, "*i8"), (0, "*fp8e4nv"), (4, "*u8"), (8, "*i8")):
        for dtype in ("bf16", "fp16", "fp32"):
            config = quant_gemv.gemv_config(kind, 128)
            options = {key: config.pop(key) for key in ("num_warps", "num_stages")}
            pointers = {"x_ptr": "*" + dtype, "w_ptr": weight, "scale_ptr": "*fp32",
                        "offset_ptr": "*fp32", "bias_ptr": "*" + dtype, "out_ptr": "*" + dtype}
            constexprs = dict(config, KIND=kind, HAS_OFFSETS=kind == 4, HAS_BIAS=True)
            kernel = _compile(quant_gemv._quant_gemv_kernel, pointers, constexprs, **options)
            regs, spills = _registers_and_spills(kernel)
            case = ("gemv", kind, weight, dtype)
            assert spills == 0, f"{case}: {spills} bytes of spills"
            print(case, f"{regs} registers, {spills} bytes spilled")


def _fused_moe() -> None:
    """fused_moe's two grouped GEMMs (kernels/moe.py) at the launcher's tiles, 16-bit and fp32,
    with biases and both activations; 16-bit tiles never spill."""
    import torch

    from kernels import moe

    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16),
                               ("fp32", torch.float32)):
        config = moe.launch_config(torch_dtype)
        options = {key: config.pop(key) for key in ("num_warps", "num_stages")}
        ieee = dtype == "fp32"
        for oai in (False, True):
            pointers = {"x_ptr": "*" + dtype, "w_ptr": "*" + dtype, "bias_ptr": "*" + dtype,
                        "act_ptr": "*" + dtype, "sorted_ptr": "*i32",
                        "block_expert_ptr": "*i32"}
            kernel = _compile(moe._moe_gate_up_kernel, pointers,
                              dict(config, OAI=oai, HAS_BIAS=True, IEEE=ieee,
                                   BLOCK_M=moe.BLOCK_M),
                              floats=["limit", "alpha"], **options)
            regs, spills = _registers_and_spills(kernel)
            case = ("moe gate_up", dtype, oai)
            assert dtype == "fp32" or spills == 0, f"{case}: {spills} bytes of spills"
            print(case, f"{regs} registers, {spills} bytes spilled")
        pointers = {"act_ptr": "*" + dtype, "w_ptr": "*" + dtype, "bias_ptr": "*" + dtype,
                    "topk_weights_ptr": "*fp32", "y_ptr": "*fp32", "sorted_ptr": "*i32",
                    "block_expert_ptr": "*i32"}
        kernel = _compile(moe._moe_down_kernel, pointers,
                          dict(config, HAS_BIAS=True, IEEE=ieee, BLOCK_M=moe.BLOCK_M), **options)
        regs, spills = _registers_and_spills(kernel)
        case = ("moe down", dtype)
        assert dtype == "fp32" or spills == 0, f"{case}: {spills} bytes of spills"
        print(case, f"{regs} registers, {spills} bytes spilled")


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
