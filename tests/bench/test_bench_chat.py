"""`folio bench chat` (client/bench/chat.py): its arguments and workload, its numbers and report
from fabricated runs, and one short real run of its three columns on the tiny model, whose
prefill counts must show the host tier at work. Speed is the benchmark's business: nothing
here asserts a time beyond "positive"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from client.bench import report
from client.bench.chat import (
    DEFAULT_CHAT_PEERS,
    ChatRun,
    ChatSpec,
    Conversations,
    Turn,
    device_blocks,
    parse_chat_peers,
    same_replies,
    serve_args,
    summarize,
)
from client.bench.cli import build_parser
from client.bench.metrics import MODES, aggregate

ROOT = Path(__file__).resolve().parents[2]
TINY_RANDOM = "folio:tiny-random"  # checkpoints.named_models


# ---- arguments and workload -----------------------------------------------------------------

def test_chat_mode_arguments_and_columns():
    assert "chat" in MODES
    args = build_parser().parse_args(["chat", "--conversations", "10", "--turns", "3",
                                      "--concurrency", "2", "--tier-gib", "0.5"])
    assert (args.conversations, args.turns, args.concurrency, args.tier_gib) == (10, 3, 2, 0.5)
    assert parse_chat_peers(None) == list(DEFAULT_CHAT_PEERS)
    assert parse_chat_peers("folio-no-prefix-cache, folio,folio") == ["folio-no-prefix-cache",
                                                                      "folio"]
    with pytest.raises(SystemExit, match="chat mode runs the columns"):
        parse_chat_peers("folio,vllm")
    assert serve_args("folio-host-tier", args) == ["--kv-offloading-size", "0.5"]
    assert serve_args("folio-no-prefix-cache", args) == ["--no-prefix-caching"]
    assert serve_args("folio", args) == []


@pytest.mark.parametrize("fields, match", [
    ({"num_conversations": 0}, "at least 1"),
    ({"concurrency": 0}, "at least 1"),
    ({"system_len": -1}, "--system-len"),
    ({"num_systems": 30}, "more than there are conversations"),
    ({"num_turns": 40}, "more than the model's context"),
])
def test_bad_chat_workloads_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        ChatSpec(**fields)


def test_conversations_are_seeded_share_system_prompts_and_change_with_the_repetition():
    spec = ChatSpec(num_conversations=6, num_turns=3, system_len=20, num_systems=2,
                    user_len=5, output_len=4, vocab_size=100)
    a, again, other = (Conversations.draw(spec, 0), Conversations.draw(spec, 0),
                       Conversations.draw(spec, 1))
    assert a == again and a != other
    assert [len(s) for s in a.systems] == [20, 20]
    assert [[len(u) for u in turns] for turns in a.users] == [[5, 5, 5]] * 6
    assert a.system_of(0) == a.system_of(2) == a.system_of(4) != a.system_of(1)
    assert max(t for turns in a.users for u in turns for t in u) < 100
    assert spec.context_len == 20 + 3 * (5 + 4)


def test_the_default_device_pool_holds_the_conversations_in_flight_not_all_of_them():
    spec = ChatSpec()  # 24 conversations, 4 in flight
    blocks = device_blocks(spec)
    in_flight = spec.concurrency * spec.context_len
    assert in_flight < blocks * 16 < spec.num_conversations * spec.context_len / 3


# ---- numbers and report ---------------------------------------------------------------------

def fabricated_run(computed: float, hits: float, host_hits: float, last_reply: list[int]
                   ) -> ChatRun:
    turns = [Turn(0, 0, 100, [1, 2], 0.10, 0.30), Turn(1, 0, 100, [3, 4], 0.20, 0.40),
             Turn(0, 1, 150, [5, 6], 0.05, 0.20), Turn(1, 1, 150, last_reply, 0.07, 0.25)]
    return ChatRun(2.0, turns, {"computed": computed, "hits": hits, "host_hits": host_hits,
                                "preemptions": 0.0})


def test_a_runs_numbers_follow_their_definitions():
    run = fabricated_run(computed=180, hits=320, host_hits=200, last_reply=[7, 8])
    m = summarize(run)
    assert m["prompt tokens"] == 500 and m["prefill tokens computed"] == 180
    assert m["prefill saved (%)"] == pytest.approx(64.0)
    assert m["prefix hits, device (tokens)"] == 120 and m["prefix hits, host tier (tokens)"] == 200
    assert m["TTFT first turns p50 (ms)"] == pytest.approx(100.0)  # nearest rank of 2
    assert m["TTFT later turns p50 (ms)"] == pytest.approx(50.0)
    assert m["TTFT later turns p90 (ms)"] == pytest.approx(70.0)
    assert m["output tokens"] == 8 and m["output tok/s"] == pytest.approx(4.0)
    assert same_replies(run, fabricated_run(0, 0, 0, [7, 8])) == 100.0
    assert same_replies(run, fabricated_run(0, 0, 0, [7, 9])) == 75.0


def test_report_puts_the_columns_side_by_side_with_the_tier_ratio(tmp_path):
    plain = summarize(fabricated_run(400, 100, 0, [7, 8]))
    tier = summarize(fabricated_run(180, 320, 200, [7, 8])) | {"same replies as folio (%)": 100.0}
    aggregates = {"folio": aggregate([plain]), "folio-host-tier": aggregate([tier])}
    result = {
        "mode": "chat", "name": "2026-01-01-chat", "dtype": "float32", "reps": 1,
        "competing_load": False, "load_before": [0.5, 0, 0], "load_after": [0.7, 0, 0],
        "machine": report.machine_facts(),
        "model": {"dir": "/m", "architecture": "LlamaForCausalLM", "random_weights": True},
        "workload": ChatSpec().to_dict(),
        "pools": {"block_size": 16, "device_blocks": 208, "device_tokens": 3328,
                  "all_conversations_tokens": 15360, "tier_gib": 2.0},
        "skipped": {"folio-no-prefix-cache": "failed to start: x"},
    }
    paths = report.write(tmp_path, result["name"], result, aggregates)
    text = paths["md"].read_text()
    assert "| metric | folio | folio-host-tier | folio-host-tier / folio |" in text
    assert "| prefill tokens computed | 400 | 180 | 0.45 |" in text
    assert "24 conversations of 4 turns" in text and "host tier: 2 GiB" in text
    assert "(3328 tokens; all conversations hold 15360)" in text
    assert "- folio-no-prefix-cache skipped: failed to start: x" in text
    saved = json.loads(paths["json"].read_text())["summary"]
    assert saved["folio-host-tier"]["prefix hits, host tier (tokens)"]["median"] == 200


# ---- the real command -----------------------------------------------------------------------

@pytest.mark.e2e
def test_chat_end_to_end_on_the_tiny_model(tmp_path, folio_cache_dir):
    """Six conversations of three turns in a device pool that holds about a third of them: the
    tier's column copies prefixes back, computes less prefill than the plain prefix cache, and
    replies the same tokens; without a prefix cache every prompt token is computed."""
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "client.cli", "bench", "chat", "--model", TINY_RANDOM,
           "--conversations", "6", "--turns", "3", "--system-len", "32", "--num-systems", "2",
           "--user-len", "16", "--output-len", "8", "--concurrency", "2", "--tier-gib", "0.05",
           "--peers", "folio,folio-host-tier,folio-no-prefix-cache", "--reps", "1",
           "--out", str(out), "--name", "chat"]
    env = {**os.environ, "FOLIO_CACHE_DIR": str(folio_cache_dir), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    result = json.loads(next(out.glob("*-chat.json")).read_text())
    assert result["skipped"] == {}
    assert result["pools"]["device_tokens"] < result["pools"]["all_conversations_tokens"] / 2
    server = {name: runs[0]["server"] for name, runs in result["runs"].items()}
    prompt = {name: sum(t["prompt_len"] for t in runs[0]["turns"])
              for name, runs in result["runs"].items()}
    assert len(set(prompt.values())) == 1  # the same conversations, replies included
    for name, s in server.items():
        assert s["preemptions"] == 0
        assert s["computed"] + s["hits"] == prompt[name], name  # every prompt token, once
    assert server["folio-no-prefix-cache"]["hits"] == 0
    assert server["folio"]["host_hits"] == 0
    assert server["folio-host-tier"]["host_hits"] > 0
    assert server["folio-host-tier"]["computed"] < server["folio"]["computed"]
    summary = result["summary"]
    for name in ("folio-host-tier", "folio-no-prefix-cache"):
        assert summary[name]["same replies as folio (%)"]["median"] == 100.0
    assert all(t["num_output"] == 8 and t["ttft_s"] > 0
               for runs in result["runs"].values() for t in runs[0]["turns"])
    table = next(out.glob("*-chat.md")).read_text()
    assert f"({result['machine']['isa']})" in table and "folio-host-tier / folio" in table
