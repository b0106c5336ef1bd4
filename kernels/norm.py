"""rms_norm with an optional fused residual add (Triton).

One program normalizes one token's row; the whole hidden dimension sits in registers (hidden up
to 8192 in the models we serve). Rounding follows transformers: the residual sum is rounded to
the model dtype before it is normalized, the normalization runs in fp32, and the normalized row
is cast back before the weight multiply.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
    stride_x, stride_residual, stride_out, stride_new_residual,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_new_residual + offs, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / hidden
    h = h * (1.0 / tl.sqrt(variance + eps))
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * h.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden] (any leading dims)
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # like x
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.stride(-1) == 1, "weight must be [hidden]"
    assert residual is None or residual.shape == x.shape, "residual must be shaped like x"
    rows = _rows(x)  # [num_tokens, hidden]
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_rows = _rows(residual) if residual is not None else None
    new_residual = torch.empty_like(rows) if residual is not None else None
    num_tokens = rows.shape[0]
    if num_tokens > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            rows, res_rows if res_rows is not None else rows, weight, out,
            new_residual if new_residual is not None else out,
            rows.stride(0), res_rows.stride(0) if res_rows is not None else 0, out.stride(0),
            new_residual.stride(0) if new_residual is not None else 0,
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )  # fmt: skip
    if new_residual is None:
        return out.view(x.shape)
    return out.view(x.shape), new_residual.view(x.shape)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, hidden] with a contiguous last dim: a view when the layout allows."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
