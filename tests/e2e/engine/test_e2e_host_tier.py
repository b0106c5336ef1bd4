"""The host tier outliving the executor, with real processes: `folio serve --kv-offloading-size`
keeps the tier in a file in shared memory it owns; the executor is killed with SIGKILL under 16
streams that share a long prefix; the restarted executor maps the same file, the scheduler
carries over the blocks the file still vouches for, and the resumed streams read their prefix
back from the tier (prefix_cache_host_hits grows) and equal an unbroken run token for token.
A tier file damaged while no executor runs (its header, or every block) is detected and
ignored: the streams recompute and still equal the unbroken run. The file is gone once the
server stops. The same kill at TP = 2 (one file, each rank its records and blocks) resumes from
the tier alike. At TP = 2 an evicted prefix also comes back from the tier under preemption,
HF-exact."""

from __future__ import annotations

import asyncio
import glob
import os
import re
import signal

import pytest

from client import AsyncFolioClient
from protos.kv_tier_file import HEADER_BYTES, TierFile, read_identity
from tests.conftest import _descendants
from tests.e2e.engine.test_e2e_faults import executor_pid, run_all, wait_health
from tests.e2e.hf_oracle import hf_greedy, load_hf_model, random_prompts
from tests.e2e.models.test_e2e_greedy import MAX_TOKENS as MAX_GREEDY
from tests.e2e.models.test_e2e_greedy import generate_all
from tests.fixtures.checkpoints import make_checkpoint

NUM_STREAMS = 16
PREFIX = 96
MAX_TOKENS = 48

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("llama3", tmp_path_factory.mktemp("ckpt-host-tier"))


async def kill_under_streams(folio_server, checkpoint, seed: int, after_kill,
                             tensor_parallel_size: int = 1) -> dict:
    """NUM_STREAMS greedy streams sharing a PREFIX-token prefix, run once as the reference and
    again with the executor (all its ranks) killed (SIGKILL) once all have started;
    `after_kill(tier_path, client)` runs right after the kill. The reference and resumed outputs, the host-tier hits
    counter before the second run and after it, the tier file and the server's log."""
    (prefix,) = random_prompts(256, (PREFIX,), seed=seed)
    tails = random_prompts(256, [3 + i % 5 for i in range(NUM_STREAMS)], seed=seed + 1)
    reqs = [dict(token_ids=prefix + tail, temperature=0.0, max_tokens=MAX_TOKENS,
                 ignore_eos=True) for tail in tails]
    args = ["--block-size", "16", "--kv-offloading-size", "0.05",
            "--tensor-parallel-size", str(tensor_parallel_size)]
    with folio_server(model=checkpoint, args=args) as server:
        # This server's file (named for its pid): other servers on the host have their own.
        own = f"/dev/shm/folio-kv-tier-{server.proc.pid}"
        tier_files = {own} & set(glob.glob("/dev/shm/folio-kv-tier-*"))
        reference = await run_all(server.address, reqs, "ref", [0])
        async with AsyncFolioClient(server.address) as client:
            hits_before = (await client.stats())["prefix_cache_host_hits"]
            progress = [0]
            streams = asyncio.ensure_future(run_all(server.address, reqs, "run", progress))
            while progress[0] < NUM_STREAMS and not streams.done():
                await asyncio.sleep(0.01)
            for pid in executor_pids(server.proc.pid):  # the launcher and its ranks at TP > 1
                os.kill(pid, signal.SIGKILL)
            await after_kill(tier_files, client)
            results = await streams
            stats = await client.stats()
        log = server.log_tail(200_000)
    left = {own} & set(glob.glob("/dev/shm/folio-kv-tier-*"))
    return dict(reference=reference, results=results, hits_before=hits_before,
                hits=stats["prefix_cache_host_hits"], tier_files=tier_files, log=log, left=left)


def executor_pids(server_pid: int) -> list[int]:
    """The executor's processes under the server: one, or a launcher and its ranks."""
    pids = [executor_pid(server_pid)]
    for pid in _descendants(pids[0]):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"executor_svc" in f.read():
                    pids.append(pid)
        except OSError:
            continue
    return pids


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
async def test_killed_executor_resumes_from_the_host_tier(folio_server, checkpoint,
                                                          tensor_parallel_size):
    """At TP = 2 each rank maps its own records and blocks of one file; a slot carries over
    only if both ranks' records vouch for it."""
    async def wait_down(tier_files, client):
        assert len(tier_files) == 1 or not os.path.isdir("/dev/shm")
        await wait_health(client, "NOT_SERVING", 10)

    run = await kill_under_streams(folio_server, checkpoint, 21, wait_down,
                                   tensor_parallel_size)
    assert run["results"] == run["reference"]
    (carried,) = re.findall(r"host tier carried over\s+num_kept=(\d+) num_promised=(\d+)",
                            run["log"])
    assert int(carried[0]) >= PREFIX // 16 and int(carried[1]) >= int(carried[0])
    # Every resumed stream found the whole shared prefix in the tier instead of recomputing it.
    assert run["hits"] - run["hits_before"] >= NUM_STREAMS * PREFIX
    assert not run["left"], "tier file left behind"


def damage(path: str, where: str) -> None:
    """Flip bytes of the tier file: in its header, or the first of every slot's block."""
    with open(path, "rb") as f:
        identity = read_identity(f.read(HEADER_BYTES))
    tier = TierFile.open(path, identity)
    slots = [tier.slot_offset(0, s) for s in range(identity.num_slots)]
    tier.close()
    with open(path, "r+b") as f:
        for at in [20] if where == "header" else slots:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("where", ["header",
                                   pytest.param("blocks", marks=pytest.mark.slow)])
async def test_a_damaged_tier_file_is_ignored(folio_server, checkpoint, where):
    async def damage_it(tier_files, client):
        (path,) = tier_files
        damage(path, where)  # before the restarted executor (seconds away) says Hello

    run = await kill_under_streams(folio_server, checkpoint, 23, damage_it)
    assert run["results"] == run["reference"]
    assert run["hits"] == run["hits_before"]  # nothing read back from the tier
    if where == "header":  # the executor replaced it; the scheduler finds no promise kept
        assert "host tier file created" in run["log"]
    carried = re.findall(r"host tier carried over\s+num_kept=(\d+)", run["log"])
    assert carried == ["0"], [line for line in run["log"].splitlines() if "host tier" in line]


async def test_tensor_parallel_host_tier_hits_decode_as_hf(folio_server, checkpoint):
    """TP = 2 (each rank its KV heads in its part of the tier file): a family's prefix evicted from a
    24-block device pool by two other families comes back from the tier, with preemption, and
    every stream is HF's greedy answer."""
    model = load_hf_model(checkpoint)
    prefixes = random_prompts(model.config.vocab_size, (PREFIX,) * 3, seed=25)
    tails = random_prompts(model.config.vocab_size, (4, 7, 10, 5, 9, 6), seed=26)
    a, b, c = ([p + t for t in tails] for p in prefixes)
    with folio_server(model=checkpoint, args=["--block-size", "16", "--num-kv-blocks", "24",
                                              "--tensor-parallel-size", "2",
                                              "--kv-offloading-size", "0.05"]) as server:
        async with AsyncFolioClient(server.address) as client:
            for prompts in (a[:2], b[:2] + c[:2]):
                got = await generate_all(server.address, prompts)
                assert got == hf_greedy(model, prompts, MAX_GREEDY)
            before = await client.stats()
            again = a[2:6] + c[2:4]
            got = await generate_all(server.address, again)
            stats = await client.stats()
    assert got == hf_greedy(model, again, MAX_GREEDY)
    assert stats["prefix_cache_host_hits"] - before["prefix_cache_host_hits"] >= PREFIX
    assert stats["num_preemptions"] > before["num_preemptions"]
    assert stats["host_kv_blocks_total"] > 0
