"""The quantized matmul kernels compiled on a GPU at Llama-3.1-8B's linear shapes, in bf16 and
fp16, against their torch twins in fp32 (the same quantized weights; only the math differs):
w8a16_linear (int8, e4m3) and group_quant_linear (GPTQ/AWQ-style 4-bit with offsets, act order
through g_idx, 8-bit GGUF-style groups)."""

import pytest
import torch

from kernels import twins
from tests.kernels.test_group_quant_linear import args, grouped
from tests.kernels.test_quant_linear import quantized

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
DTYPES = (torch.bfloat16, torch.float16)
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (N, K): o_proj, up, down
ROWS = (1, 16, 512)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # Relative to the output's scale: K-long fp32 sums of 16-bit operands.
    scale = want.abs().max().clamp(min=1.0)
    torch.testing.assert_close(got.float() / scale, want.float() / scale, atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", SHAPES)
def test_w8a16_8b_shapes(triton_ops, dtype, weight_dtype, shape):
    n, k = shape
    weight, scale = quantized(n, k, weight_dtype)
    for rows in ROWS:
        x = torch.randn(rows, k, dtype=dtype)
        want = twins.w8a16_linear(x.float(), weight, scale, None)
        got = triton_ops.w8a16_linear(x.to(CUDA), weight.to(CUDA), scale.to(CUDA), None)
        _close(got.cpu(), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", [(4, 128, False), (4, 128, True), (8, 32, False)])
@pytest.mark.parametrize("shape", SHAPES)
def test_group_quant_8b_shapes(triton_ops, dtype, variant, shape):
    bits, group_size, act_order = variant
    n, k = shape
    gw = grouped(n, k, bits, group_size, offsets=bits == 4, act_order=act_order)
    host = args(gw)
    device = [t.to(CUDA) if isinstance(t, torch.Tensor) else t for t in host]
    for rows in ROWS:
        x = torch.randn(rows, k, dtype=dtype)
        want = twins.group_quant_linear(x.float(), *host, None)
        got = triton_ops.group_quant_linear(x.to(CUDA), *device, None)
        _close(got.cpu(), want, dtype)
