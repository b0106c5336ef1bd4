"""The decode graph runner's bookkeeping, replayed eagerly on the CPU: padded decode steps are
token-exact with the eager runner, padded rows write nothing to the KV cache, the static
buffers keep their addresses, and mixed or oversized steps stay eager. The eager runner is the
oracle. (Real CUDA capture/replay: test_graph_runner_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from executor_svc.step.graph_runner import MAX_CAPTURE_SIZE, DecodeGraphRunner, capture_sizes
from executor_svc.step.runner import ModelRunner
from protos.plan import SamplingSpec
from tests.executor.harness import PlanDriver, make_runner

NUM_BLOCKS = 200
# step -> requests arriving; with these output lengths the pure-decode steps run 3, 5, 9, 17
# and, as requests finish, fewer sequences (each padded to the next captured size).
ARRIVALS = {0: 3, 2: 2, 4: 4, 6: 8}
NUM_NEW = [9, 12, 8, 10, 6, 9, 11, 8, 5, 10, 7, 6, 9, 8, 11, 5, 7]


def with_graphs(runner: ModelRunner, max_num_seqs: int = 32) -> DecodeGraphRunner:
    """Give `runner` a graph runner that replays eagerly on the CPU (the executor does this on
    CUDA only, with real graphs)."""
    cfg = runner.model.cfg
    graphs = DecodeGraphRunner(runner.model, max_num_seqs, runner.input_batch.max_num_blocks,
                               runner.max_model_len, cfg.hidden_size, torch.float32,
                               runner.device, use_cuda_graphs=False)
    graphs.capture()
    runner.graph_runner = graphs
    return graphs


def drive(runner: ModelRunner, on_decode=None) -> tuple[dict[str, list[int]], list[int]]:
    """Requests arrive (their prefills share steps with running decodes) and finish at
    different steps. Returns each request's tokens and the sizes of the pure-decode steps.
    `on_decode(runner, running)` runs before each pure-decode step of `running`; what it returns,
    if not None, is called after that step."""
    driver = PlanDriver(NUM_BLOCKS, seed=3)
    generated: dict[str, list[int]] = {}
    running: list[str] = []
    decode_sizes: list[int] = []
    num_arrived, step = 0, 0
    while step <= max(ARRIVALS) or running:
        arriving = [f"r{num_arrived + i}" for i in range(ARRIVALS.get(step, 0))]
        num_arrived += len(arriving)
        done = [r for r in running if len(generated[r]) >= NUM_NEW[int(r[1:])]]
        running = [r for r in running if r not in done]
        after = None
        if running and not arriving:
            decode_sizes.append(len(running))
            if on_decode is not None:
                after = on_decode(runner, running)
        prompts = {r: [(11 * int(r[1:]) + j) % 290 + 1 for j in range(3 + int(r[1:]) % 6)]
                   for r in arriving}
        out = runner.execute(driver.plan(
            new_reqs=[driver.new(r, prompts[r], len(prompts[r])) for r in arriving],
            cached_reqs=driver.decode_all(running), finished_req_ids=done))
        if after is not None:
            after()
        driver.record(out.sampled)
        for req_id, ids in out.sampled:
            generated.setdefault(req_id, []).extend(ids)
        running += arriving
        step += 1
    return generated, decode_sizes


def test_capture_sizes_follow_the_ladder_and_cover_max_num_seqs():
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:], strict=False))
    assert capture_sizes(5) == [1, 2, 4, 8]  # the first size past 5 covers a full batch
    assert capture_sizes(1) == [1] and capture_sizes(8) == [1, 2, 4, 8]
    big = capture_sizes(10_000)
    assert big[-1] == MAX_CAPTURE_SIZE and 272 in big and 264 not in big  # steps of 16 past 256
    assert capture_sizes(600, limit=64)[-1] == 64


@pytest.mark.parametrize("arch", ["llama2", "qwen3"])
def test_padded_decode_steps_are_token_exact_with_eager(checkpoint_cache, arch):
    _, model_dir = checkpoint_cache(arch)
    eager, eager_sizes = drive(make_runner(model_dir, NUM_BLOCKS))
    runner = make_runner(model_dir, NUM_BLOCKS)
    graphs = with_graphs(runner)
    replayed, sizes = drive(runner)
    assert replayed == eager and sizes == eager_sizes
    assert {3, 5, 9, 17} <= set(sizes)  # batches that need padding (to 4, 8, 16, 24)
    expected = {graphs.padded_size(n) for n in sizes}
    assert set(graphs.num_replays) == expected and {4, 8, 16, 24} <= expected
    assert sum(graphs.num_replays.values()) == len(sizes)  # every pure decode, nothing else


def test_padded_rows_write_nothing_to_the_kv_cache(checkpoint_cache):
    """Before each padded step every KV slot no held request owns is poisoned with NaN; after
    it, those slots are still NaN and only the step's own slots changed, and the tokens are
    still the eager runner's."""
    _, model_dir = checkpoint_cache("llama3")
    eager, _ = drive(make_runner(model_dir, NUM_BLOCKS))
    runner = make_runner(model_dir, NUM_BLOCKS)
    graphs = with_graphs(runner)
    checked: list[int] = []

    def poison_then_check(runner: ModelRunner, running: list[str]):
        n = len(running)
        if graphs.padded_size(n) == n:
            return None
        batch = runner.input_batch
        rows = [batch.row_of[r] for r in running]
        owned = torch.zeros(NUM_BLOCKS, dtype=torch.bool)
        for row in rows:
            owned[torch.from_numpy(batch.block_table[row, :batch.num_blocks[row]]).long()] = True
        caches = [*runner.kv_cache.k_caches, *runner.kv_cache.v_caches]
        for cache in caches:
            cache[~owned] = float("nan")
        before = [c.clone() for c in caches]

        def after() -> None:
            # The slot each row wrote: its last computed position (its block may be new).
            pos = batch.num_computed[rows] - 1
            slots = batch.block_table[rows, pos // runner.block_size] * runner.block_size + (
                pos % runner.block_size)
            for old, new in zip(before, caches, strict=True):
                old, new = old.flatten(0, 1), new.flatten(0, 1)  # [num_slots, heads, head_dim]
                same = (old == new) | (old.isnan() & new.isnan())
                changed = (~same).flatten(1).any(1).nonzero().flatten()
                assert sorted(changed.tolist()) == sorted(slots.tolist())
                poisoned = old.isnan().flatten(1).all(1)  # [num_slots]
                poisoned[torch.from_numpy(slots).long()] = False  # written by real rows
                assert poisoned.sum() >= NUM_BLOCKS and new[poisoned].isnan().all()
            checked.append(n)

        return after

    replayed, _ = drive(runner, poison_then_check)
    assert checked and replayed == eager


def test_static_buffers_keep_their_addresses(checkpoint_cache):
    _, model_dir = checkpoint_cache("llama2")
    runner = make_runner(model_dir, NUM_BLOCKS)
    graphs = with_graphs(runner)
    names = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc",
             "block_tables", "logits_indices", "hidden")
    ptrs = {name: getattr(graphs, name).data_ptr() for name in names}
    seen: list[int] = []

    def record(runner: ModelRunner, running: list[str]) -> None:
        seen.append(len(running))
        assert {name: getattr(graphs, name).data_ptr() for name in names} == ptrs

    drive(runner, record)
    assert {name: getattr(graphs, name).data_ptr() for name in names} == ptrs
    assert len({graphs.padded_size(n) for n in seen}) >= 4  # several sizes replayed


def test_mixed_and_oversized_steps_run_eagerly(checkpoint_cache):
    _, model_dir = checkpoint_cache("llama2")
    runner = make_runner(model_dir, NUM_BLOCKS)
    graphs = with_graphs(runner, max_num_seqs=4)
    assert graphs.sizes == [1, 2, 4]
    driver = PlanDriver(NUM_BLOCKS, seed=5)
    greedy = SamplingSpec(temperature=0.0)
    names = [f"q{i}" for i in range(6)]

    def step(**kwargs):
        out = runner.execute(driver.plan(**kwargs))
        driver.record(out.sampled)
        return out

    step(new_reqs=[driver.new(r, [i + 1, i + 2, i + 3], 3, greedy)
                   for i, r in enumerate(names[:3])])
    assert sum(graphs.num_replays.values()) == 0  # prefill only
    step(cached_reqs=driver.decode_all(names[:3]))
    assert graphs.num_replays == {4: 1}  # pure decode of 3, padded to 4
    step(new_reqs=[driver.new(names[3], [7, 8, 9, 10], 4, greedy)],
         cached_reqs=driver.decode_all(names[:3]))
    assert graphs.num_replays == {4: 1}  # a mixed step: eager
    step(new_reqs=[driver.new(r, [5, 6], 2, greedy) for r in names[4:]],
         cached_reqs=driver.decode_all(names[:4]))
    step(cached_reqs=driver.decode_all(names))
    assert graphs.num_replays == {4: 1}  # 6 decodes: past the largest size, eager
    step(cached_reqs=driver.decode_all(names[:2]), finished_req_ids=names[2:])
    assert graphs.num_replays == {4: 1, 2: 1}
