"""silu_and_mul: the gated MLP activation silu(gate) * up over a fused [gate | up] row (Triton).

silu runs in fp32 and is rounded to the activation dtype before the multiply, matching torch's
`F.silu(gate) * up` in 16-bit dtypes.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, intermediate, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < intermediate
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + intermediate + offs, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * intermediate]
    assert x.shape[-1] % 2 == 0, "x must be [..., 2 * intermediate]"
    rows = x.reshape(-1, x.shape[-1])  # a view when the layout allows
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_tokens, intermediate = rows.shape[0], rows.shape[1] // 2
    out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    if num_tokens > 0:
        block = min(triton.next_power_of_2(intermediate), 1024)
        grid = (num_tokens, triton.cdiv(intermediate, block))
        _silu_and_mul_kernel[grid](
            rows, out, rows.stride(0), out.stride(0), intermediate, BLOCK=block
        )
    return out.view(*x.shape[:-1], intermediate)  # [num_tokens, intermediate]
