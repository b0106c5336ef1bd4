"""Split-K for the weight-streaming linears (kernels/quant_linear.py, kernels/grouped_linear.py).

A decode step multiplies a few rows by a large weight matrix: one program per (M tile, N tile)
leaves most of a GPU idle when N / BLOCK_N is below a few programs per SM. Splitting K across
programs fills it; each split writes its fp32 partial product to its own slice of a
[splits, M, N] buffer, and the slices are summed in a fixed order afterwards (deterministic,
unlike atomics), then bias is added and the result cast. The split count depends only on the
shapes and the device, so a CUDA graph captures the same launch it replays.
"""

import torch
import triton

WAVES = 4  # programs per SM a decode launch aims for
INTERPRETER_SMS = 2  # CPU (interpreter) runs: small shapes split too, so tests cover it


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS


def launch_shape(x: torch.Tensor, n: int, k: int, config: dict):
    """(grid, K per split, output buffer) for x [M, K] times an [N, K] weight; pops SPLIT_K
    (forced split count) and WAVES from config, leaving the kernel's own parameters."""
    m = x.shape[0]
    forced, waves = config.pop("SPLIT_K", None), config.pop("WAVES", WAVES)
    tiles = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
    k_tiles = triton.cdiv(k, config["BLOCK_K"])
    split = forced or max(1, min(k_tiles, waves * num_sms(x.device) // tiles))
    k_per_split = triton.cdiv(k_tiles, split) * config["BLOCK_K"]
    split = triton.cdiv(k, k_per_split)  # no empty split
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]), split)
    if split == 1:
        return grid, k_per_split, torch.empty((m, n), dtype=x.dtype, device=x.device)
    return grid, k_per_split, torch.empty((split, m, n), dtype=torch.float32, device=x.device)


def finish_split(out: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """The kernel's output: as it is (one split: bias added, cast in the kernel), or the
    splits summed, bias added and cast to dtype."""
    if out.dim() == 2:
        return out
    total = out.sum(0)
    if bias is not None:
        total += bias.float()
    return total.to(dtype)
