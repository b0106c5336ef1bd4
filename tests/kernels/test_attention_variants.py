"""The attention variants (sliding window, logit softcap, sinks) of the torch twin against the
float64 reference; blocks wholly below a sequence's window hold NaN, so a read shows."""

import pytest
import torch

from kernels import twins
from tests.kernels.attention_reference import poison_outside_windows, reference_attention
from tests.kernels.conftest import make_paged_batch

# (seq_len including new tokens, q_len): decodes far past the window, a fresh prompt longer
# than it, chunks starting mid-block past it, and a sequence shorter than the window.
SEQS = [(70, 1), (45, 45), (90, 13), (6, 1), (33, 8)]
VARIANTS = {
    "window": dict(window=16),
    "window-1": dict(window=1),
    "window-odd": dict(window=21),
    "softcap": dict(softcap=5.0),
    "sinks": dict(sinks=True),
    "all": dict(window=16, softcap=5.0, sinks=True),
}


def variant_args(name: str, num_heads: int) -> dict:
    args = dict(VARIANTS[name])
    if args.get("sinks"):
        args["sinks"] = torch.linspace(-2.0, 3.0, num_heads)
    return args


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2)])
def test_twin_variants_match_reference(name, num_heads, num_kv_heads):
    batch = make_paged_batch(SEQS, num_heads, num_kv_heads, 32, 8, torch.float32,
                             torch.device("cpu"))
    args = variant_args(name, num_heads)
    if args.get("window"):
        assert poison_outside_windows(batch, args["window"]) > 0
    out = twins.paged_attention(*batch.args(), **args)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), reference_attention(batch, **args), atol=1e-5,
                               rtol=1e-5)


def test_window_wider_than_every_context_is_plain_attention():
    batch = make_paged_batch(SEQS, 4, 2, 32, 8, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(twins.paged_attention(*batch.args(), window=1000),
                               twins.paged_attention(*batch.args()))
