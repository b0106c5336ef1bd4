"""Quantized-KV test cases shared by the CPU/interpreter tests (test_kv_quant.py) and the
compiled GPU tests (test_kv_quant_gpu.py): paged batches whose caches hold fp8 or int8 codes
with their scales, the float64 quantize-dequantize reference over them, and store_kv cases
with the codes and scales quantize_rows gives row by row.

Every slot a sequence does not own holds NaN (codes and scales), so a stray read shows, and
blocks below a window are poisoned the same way.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from kernels import kv_quant
from tests.kernels.attention_reference import poison_outside_windows, reference_attention
from tests.kernels.conftest import PagedBatch, make_paged_batch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 32, 4
KV_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
BATCHES = {
    "decode": [(70, 1), (6, 1), (33, 1), (19, 1), (1, 1), (300, 1)],
    "prefill": [(21, 21), (9, 9)],
    "chunked": [(90, 11), (35, 6)],
    "mixed": [(19, 19), (70, 1), (41, 7), (6, 1), (300, 1)],
}
VARIANTS = {"plain": {}, "window": dict(window=6), "softcap": dict(softcap=2.0),
            "sinks": dict(sinks=True)}
# Against the quantize-dequantize reference: the kernels compute on the same values, so only
# float rounding separates them (bf16: q and the P.V operands rounded to bf16).
REF_TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@dataclasses.dataclass
class QuantBatch:
    batch: PagedBatch  # caches hold codes
    k_scale: torch.Tensor  # [num_blocks, block_size, num_kv_heads] fp32
    v_scale: torch.Tensor
    dequantized: PagedBatch  # caches hold code * scale, float64

    def args(self) -> tuple:
        return self.batch.args()

    def scales(self) -> dict:
        return dict(k_scale=self.k_scale, v_scale=self.v_scale)

    def on(self, device: torch.device) -> QuantBatch:
        """The batch and scales on `device` (Triton runs compiled on a GPU)."""
        if device.type == "cpu":
            return self
        fields = {f.name: getattr(self.batch, f.name) for f in dataclasses.fields(self.batch)}
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
        return QuantBatch(PagedBatch(**moved), self.k_scale.to(device),
                          self.v_scale.to(device), self.dequantized)


def static_scales(num_blocks: int, block_size: int = BLOCK, num_kv_heads: int = NUM_KV_HEADS,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head fp8 scales other than 1, as a checkpoint gives them; stride-0 views. Heads
    alternate between a small and a large scale."""
    k_heads = torch.tensor([0.02, 0.5]).repeat(num_kv_heads)[:num_kv_heads]
    v_heads = torch.tensor([0.25, 0.004]).repeat(num_kv_heads)[:num_kv_heads]
    return (kv_quant.static_scale_view(k_heads, num_blocks, block_size),
            kv_quant.static_scale_view(v_heads, num_blocks, block_size))


def quantize_batch(batch: PagedBatch, kv_dtype: torch.dtype) -> QuantBatch:
    """Every slot quantized as store_kv would (NaN slots stay NaN: codes, or the scale)."""
    num_blocks, block_size, num_kv_heads, head_dim = shape = batch.k_cache.shape
    caches, scales = [], []
    static = static_scales(num_blocks, block_size, num_kv_heads)
    for i, cache in enumerate((batch.k_cache, batch.v_cache)):
        rows = cache.reshape(-1, num_kv_heads, head_dim) * (0.3 if i == 0 else 0.02)
        if kv_dtype == torch.int8:
            codes, scale = kv_quant.quantize_rows(rows, kv_dtype)
            scale = scale.view(shape[:3]).clone()
            # A NaN row's codes are undefined after the cast: its NaN scale carries the poison.
        else:
            codes, _ = kv_quant.quantize_rows(rows, kv_dtype, static[i].reshape(-1, num_kv_heads))
            scale = static[i]
        caches.append(codes.view(shape))
        scales.append(scale)
    deq = [kv_quant.dequantize(c, s, torch.float64) for c, s in zip(caches, scales, strict=True)]
    quant = dataclasses.replace(batch, k_cache=caches[0], v_cache=caches[1])
    dense = dataclasses.replace(batch, k_cache=deq[0], v_cache=deq[1])
    return QuantBatch(quant, scales[0], scales[1], dense)


def quant_case(seqs: list[tuple[int, int]], name: str, q_dtype: torch.dtype, kv_name: str,
               seed: int, num_heads: int = NUM_HEADS, num_kv_heads: int = NUM_KV_HEADS,
               head_dim: int = HEAD_DIM, block_size: int = BLOCK,
               ) -> tuple[QuantBatch, dict, torch.Tensor]:
    """(the quantized batch on the CPU, the variant's kwargs, the float64 reference) for
    sequences of (seq_len, q_len) under VARIANTS[name]."""
    batch = make_paged_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, q_dtype,
                             torch.device("cpu"), seed=seed)
    args = dict(VARIANTS[name])
    if args.get("sinks"):
        args["sinks"] = torch.linspace(-2.0, 3.0, num_heads)
    if args.get("window"):
        # A prefill's first query sees from key 0: only batches with context have blocks below.
        poisoned = poison_outside_windows(batch, args["window"])
        assert poisoned > 0 or all(s == q for s, q in seqs)
    qb = quantize_batch(batch, KV_DTYPES[kv_name])
    return qb, args, reference_attention(qb.dequantized, **args)


@functools.cache
def case(kind: str, name: str, q_dtype: torch.dtype, kv_name: str):
    """quant_case for one of BATCHES at the small test shape (cached: references are slow)."""
    return quant_case(BATCHES[kind], name, q_dtype, kv_name, seed=len(kind) * 7 + len(name))


def check(got: torch.Tensor, q_dtype: torch.dtype, reference: torch.Tensor) -> None:
    assert not got.isnan().any(), "an unwritten row, or a read outside a sequence's keys"
    tol = REF_TOL[q_dtype]
    torch.testing.assert_close(got.double(), reference, atol=tol, rtol=tol)


# --- store_kv ---------------------------------------------------------------------------------


def store_case(kv_dtype: torch.dtype, q_dtype: torch.dtype):
    """(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale): 13 tokens, two of them
    padding (slot -1), into zeroed caches; int8's scales start NaN, fp8's are static."""
    num_blocks, num_tokens = 6, 13
    gen = torch.Generator().manual_seed(3)
    key = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen) * 0.4).to(q_dtype)
    value = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen) * 0.01).to(q_dtype)
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:num_tokens]
    slots[[2, 9]] = -1  # padding
    shape = (num_blocks, BLOCK, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)
    if kv_dtype == torch.int8:
        k_scale = torch.full(shape[:3], float("nan"))
        v_scale = torch.full(shape[:3], float("nan"))
    else:
        k_scale, v_scale = static_scales(num_blocks)
    return key, value, k_cache, v_cache, slots, k_scale, v_scale


def expected_store(key, value, slots, kv_dtype, k_scale, v_scale):
    """Per written slot (codes, scale) by quantize_rows, row by row."""
    block_size = k_scale.shape[1]
    out = {}
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, block_size)
        for name, x, scale in (("k", key, k_scale), ("v", value, v_scale)):
            static = None if kv_dtype == torch.int8 else scale[b, o][None]
            codes, row_scale = kv_quant.quantize_rows(x[t:t + 1], kv_dtype, static)
            out[name, b, o] = (codes[0], row_scale[0])
    return out


def check_store(k_cache, v_cache, k_scale, v_scale, expected, kv_dtype, exact: bool):
    """Written slots hold the expected codes (`exact`: bit for bit; else within one rounding
    step, a device division landing a tie on the other side) and scales; no other slot was
    touched."""
    for (name, b, o), (codes, scale) in expected.items():
        cache, scales = (k_cache, k_scale) if name == "k" else (v_cache, v_scale)
        if exact:
            assert torch.equal(cache[b, o].view(torch.uint8), codes.view(torch.uint8))
        else:
            step = (cache[b, o].float() - codes.float()).abs()
            if kv_dtype == torch.int8:
                assert step.max() <= 1
            else:
                assert (step <= codes.float().abs() * 2**-3 + 2**-9).all()
        torch.testing.assert_close(scales[b, o], scale, rtol=1e-6, atol=0)
    written = {(b, o) for (_, b, o) in expected}
    for b in range(k_cache.shape[0]):
        for o in range(k_cache.shape[1]):
            if (b, o) not in written:
                assert k_cache[b, o].float().eq(0).all() and v_cache[b, o].float().eq(0).all()
                if kv_dtype == torch.int8:
                    assert k_scale[b, o].isnan().all(), "an unwritten slot's scale was touched"
