"""What sliding windows save, read from the block manager while the real scheduler drives the
real runner: a Gemma-3-shaped model at a context 8x its window keeps its local layers' KV
bounded by the window, and an all-sliding (Mistral-style) model serves a context longer than
its whole pool would hold without releases; both token for token as HF transformers."""

from __future__ import annotations

import pytest

from scheduler_svc.sched.block_manager import BlockManager
from tests.e2e.hf_oracle import hf_greedy, load_hf_model, random_prompts
from tests.executor.harness import BLOCK_SIZE, make_runner
from tests.fixtures.checkpoints import make_checkpoint
from tests.fixtures.scheduled_runner import run_scheduled

WINDOW = 16
CHUNK = 16  # the step's token budget
MAX_TOKENS = 16


def window_bound(window: int) -> int:
    """Blocks one windowed group of one sequence may hold: the window behind a chunk, the
    chunk, and the partly filled blocks at both ends."""
    return -(-(window + CHUNK) // BLOCK_SIZE) + 1


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    # Gemma 3's pattern: five local layers, then a global one.
    types = ["sliding_attention"] * 5 + ["full_attention"]
    path = make_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3"), num_hidden_layers=6,
                           layer_types=types, sliding_window=WINDOW)
    return path, load_hf_model(path)


def test_local_layers_hold_a_window_of_kv_at_8x_the_window(gemma3):
    model_dir, hf = gemma3
    runner = make_runner(model_dir, num_blocks=400)
    layout = runner.kv_cache.layout
    assert layout.windows.count(WINDOW) == 5 and layout.windows.count(0) == 1
    bm = BlockManager(400, BLOCK_SIZE, windows=layout.windows)
    prompt = random_prompts(hf.config.vocab_size, (8 * WINDOW,), seed=3)[0]
    held: list[tuple[int, int]] = []  # (windowed blocks, full-attention blocks) per step

    def read_counts(sched):
        table = bm.block_tables.get("r0")
        if table:
            full = sum(1 for b in table[0::layout.num_groups] if b >= 0)
            held.append((bm.num_windowed_blocks, full))

    outputs, sched = run_scheduled(runner, bm, [prompt], MAX_TOKENS,
                                   max_num_batched_tokens=CHUNK, on_step=read_counts)
    assert outputs == hf_greedy(hf, [prompt], MAX_TOKENS)
    windowed, full = zip(*held, strict=True)
    # The global layer's KV grows with the context; each local group's stays in its window.
    assert full[-1] == -(-(len(prompt) + MAX_TOKENS - 1) // BLOCK_SIZE)
    assert max(windowed) <= 5 * window_bound(WINDOW) < 5 * full[-1]
    assert sched.counters.num_window_released_blocks > 0


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = make_checkpoint("mistral_window", tmp_path_factory.mktemp("mistral"),
                           sliding_window=WINDOW)
    return path, load_hf_model(path)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_all_sliding_model_serves_more_than_its_pool(mistral, mode):
    model_dir, hf = mistral
    num_blocks = 2 * window_bound(WINDOW)  # 72 tokens, without releases
    lengths = (150, 140, 30)  # each longer than the pool, together far more
    prompts = random_prompts(hf.config.vocab_size, lengths, seed=5)
    runner = make_runner(model_dir, num_blocks=num_blocks,
                         num_swap_blocks=num_blocks if mode == "swap" else 0)
    assert runner.kv_cache.layout.windows == (WINDOW,)  # one group: every layer slides
    bm = BlockManager(num_blocks, BLOCK_SIZE, num_blocks if mode == "swap" else 0,
                      windows=(WINDOW,))
    assert max(lengths) + MAX_TOKENS > num_blocks * BLOCK_SIZE
    outputs, sched = run_scheduled(runner, bm, prompts, MAX_TOKENS,
                                   max_num_batched_tokens=CHUNK, preemption_mode=mode)
    assert outputs == hf_greedy(hf, prompts, MAX_TOKENS)
    assert sched.counters.num_window_released_blocks > 0
