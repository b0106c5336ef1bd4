"""The warm-up's variant list covers every launch the attention launcher can make, for every
model (softcap and sinks flags included), and the merge of split-KV partials."""

import pytest
import torch

from kernels.attention import plan_launches
from kernels.variants import attention_variants, config_key


def launched_configs(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                     max_query_len: int) -> set[tuple[tuple[str, object], ...]]:
    """The configs a step with this max_query_len launches (one token per query position)."""
    return {config_key(c) for c, _ in plan_launches(dtype, num_heads, num_kv_heads, head_dim,
                                                    max_query_len, 1, max_query_len)}


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", [
    (torch.bfloat16, 32, 8, 128), (torch.float16, 14, 2, 64), (torch.float32, 4, 2, 16),
    (torch.bfloat16, 8, 8, 80)])
@pytest.mark.parametrize("budget", [8, 2048])
def test_every_max_query_len_maps_onto_a_warmed_variant(dtype, heads, kv_heads, head_dim, budget):
    variants = attention_variants(dtype, heads, kv_heads, head_dim, budget)
    configs = {v.config for v in variants}
    assert {(v.config, v.split) for v in variants} == {(c, s) for c in configs
                                                        for s in (False, True)}
    launched = set()
    for q in range(1, budget + 1):
        launched |= launched_configs(dtype, heads, kv_heads, head_dim, q)
    assert launched == configs, "a launch the warm-up misses, or a variant no step launches"
    for v in variants:  # each variant's own max_query_len brings its launch in
        assert v.config in launched_configs(dtype, heads, kv_heads, head_dim, v.max_query_len)


@pytest.mark.parametrize("num_splits", [1, 3, 16, 17, 40])
def test_merge_splits_matches_a_float64_merge(device, num_splits):
    """The merge walks its splits in blocks: counts past one block, empty splits (lse -inf,
    partial garbage) weigh nothing, a row with no split at all gets zeros."""
    pytest.importorskip("triton")
    from kernels.attention_reduce import merge_splits

    gen = torch.Generator().manual_seed(num_splits)
    tokens, heads, dim = 3, 2, 40
    partial = torch.randn(tokens, heads, num_splits, dim, generator=gen)
    lse = torch.randn(tokens, heads, num_splits, generator=gen) * 4
    lse[0, 0, ::2] = float("-inf")  # empty splits
    partial[0, 0, ::2] = float("nan")  # never read
    lse[1, 1] = float("-inf")  # no key anywhere: zeros
    out = torch.full((tokens, heads, dim), float("nan"), device=device)
    merge_splits(partial.to(device), lse.to(device), out)
    w = torch.exp2(lse.double() - lse.double().amax(-1, keepdim=True).nan_to_num(0, 0, 0))
    w = torch.where(lse == float("-inf"), 0.0, w)
    total = w.sum(-1, keepdim=True)
    p = torch.where((lse == float("-inf"))[..., None], 0.0, partial.double())
    expected = (p * w[..., None]).sum(-2) / torch.where(total == 0, 1.0, total)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)


def test_merge_compiles_once_for_every_split_count(monkeypatch):
    """The merge's constexprs do not depend on the split count (one compile per model)."""
    pytest.importorskip("triton")
    from kernels import attention_reduce

    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **constexprs: seen.append(constexprs)

    monkeypatch.setattr(attention_reduce, "_merge_splits_kernel", Recorder())
    for splits in (2, 5, 33, 64):
        attention_reduce.merge_splits(torch.zeros(1, 2, splits, 64), torch.zeros(1, 2, splits),
                                      torch.zeros(1, 2, 64))
    assert all(c == seen[0] for c in seen) and "SPLITS_BLOCK" in seen[0]


@pytest.mark.parametrize("softcap, sinks", [(True, False), (False, True), (True, True)])
def test_a_models_flags_are_in_every_variant(softcap, sinks):
    plain = attention_variants(torch.bfloat16, 32, 8, 128, 2048)
    flagged = attention_variants(torch.bfloat16, 32, 8, 128, 2048, softcap=softcap, sinks=sinks)
    assert [(v.max_query_len, v.split, v.config) for v in flagged] == [
        (v.max_query_len, v.split, v.config) for v in plain]
    assert all(v.softcap == softcap and v.sinks == sinks for v in flagged)
    assert not any(v.softcap or v.sinks for v in plain)


def test_the_window_is_never_specialized_on():
    """One compile serves every window (0 = none): no ==1 or %16 specialization of it."""
    pytest.importorskip("triton")
    from kernels import attention

    assert "window" in attention.PER_STEP_ARGS  # the kernel's do_not_specialize list
    kernel = attention._paged_attention_kernel
    if hasattr(kernel, "params"):  # compiled, not interpreted
        assert kernel.params[kernel.arg_names.index("window")].do_not_specialize


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn, torch.int8],
                         ids=["auto", "fp8", "int8"])
@pytest.mark.parametrize("softcap, sinks", [(False, False), (True, True), (False, True)])
def test_warm_up_compiles_every_launch_of_a_models_steps(monkeypatch, softcap, sinks, kv_dtype):
    """What steps of a model with these flags launch (any max_query_len, window, split count)
    is what the warm-up launched: the same constexprs, launch options and pointer dtypes."""
    pytest.importorskip("triton")
    from executor_svc.kv.kv_cache import LayerKV
    from executor_svc.step.warmup import warm_attention
    from kernels import attention, attention_reduce

    seen: set = set()

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **constexprs):
                dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
                seen.add((self.name, dtypes, tuple(sorted(constexprs.items()))))
            return launch

    monkeypatch.setattr(attention, "_paged_attention_kernel", Recorder("attention"))
    monkeypatch.setattr(attention_reduce, "_merge_splits_kernel", Recorder("merge"))
    heads, kv_heads, dim, budget = 8, 2, 64, 40
    k_cache = torch.zeros((4, 16, kv_heads, dim), dtype=kv_dtype or torch.float16)
    scales = {}
    if kv_dtype is not None:  # a quantized cache (kernels/kv_quant.py) and its scales
        scales = dict(k_scale=torch.ones(4, 16, kv_heads), v_scale=torch.ones(4, 16, kv_heads))
    warm_attention(LayerKV(k_cache, k_cache.clone(), *scales.values()), heads, budget,
                   show_progress=False, dtype=torch.float16, softcap=softcap,
                   sinks=sinks)  # fmt: skip
    warmed, seen = seen, set()
    variant = dict(softcap=30.0 if softcap else 0.0,
                   sinks=torch.randn(heads) if sinks else None)  # fmt: skip
    for n in range(1, budget + 1):
        q = torch.zeros((n, heads, dim), dtype=torch.float16)
        for splits in (1, 3):
            for window in (0, 1, 7, 4096):
                attention.paged_attention(
                    q, k_cache, k_cache, torch.zeros((1, 4), dtype=torch.int32),
                    torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
                    n, n, 0.125, num_splits=splits, window=window, **variant,
                    **scales)  # fmt: skip
    assert seen == warmed
