"""`folio bench chat`: multi-turn conversations whose prefixes outgrow the device's KV pool, run
with and without the prefix cache's host tier.

    folio bench chat --conversations 24 --turns 4 --system-len 256 --num-systems 4 \\
        --user-len 64 --output-len 32 --concurrency 4 --tier-gib 2 \\
        --peers folio,folio-host-tier --reps 2 --out bench/results

Each conversation opens with one of `--num-systems` system prompts (tenants share them) and
then takes turns: a turn's prompt is everything said so far (the system prompt, every earlier
user message and the model's own greedy reply to it) plus a new user message of `--user-len`
random tokens; the reply is `--output-len` tokens (EOS ignored). Turns are taken round-robin
over the conversations, `--concurrency` at a time, a conversation's next turn only after its
previous reply: between two turns of one conversation every other conversation speaks once,
so with all conversations' contexts larger than the device pool, a returning conversation's
prefix has been evicted from the device and, with the tier, is still in host memory.

Columns are Folio configurations, each a `folio serve` of the same model and device pool
(`--kv-blocks` blocks of 16 tokens; by default every system prompt once plus 1.5 times what the
conversations in flight hold at their longest, far less than all conversations hold):

    folio                   the prefix cache on the device pool only
    folio-host-tier         plus the host tier (`--kv-offloading-size` = `--tier-gib`)
    folio-no-prefix-cache   no prefix cache at all: every prompt token is prefilled

Prefill counts come from the server (GetServerStats before and after each run): prompt tokens,
prefix-cache hits (the prefill skipped), and of those the ones copied back from the host tier.
TTFT is reported for first turns (nothing to reuse but the system prompt) and later turns
(where the tier matters) apart. Each repetition draws new conversations, and every column gets
the same ones; a column's replies are compared turn by turn with the first column's (greedy:
a cache hit must not change a token).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from client.bench import models, report
from client.bench.folio_peer import FolioPeer
from client.bench.load import competing_load, settle
from client.bench.metrics import Aggregate, aggregate, percentile
from client.bench.peers import resolve_model
from client.bench.runner_peer import PeerUnavailable

BLOCK_SIZE = 16
CHAT_PEERS = ("folio", "folio-host-tier", "folio-no-prefix-cache")
DEFAULT_CHAT_PEERS = ("folio", "folio-host-tier")
WARMUP_SEED_OFFSET = 1_000_003  # warm-up conversations never share a prefix with a timed one
# (Folio's counter, the delta's name in a run's numbers). num_prompt_tokens counts the prompt
# tokens computed: hits are not, a recompute after preemption counts again.
SERVER_COUNTERS = (("num_prompt_tokens", "computed"), ("prefix_cache_hits", "hits"),
                   ("prefix_cache_host_hits", "host_hits"), ("num_preemptions", "preemptions"))


@dataclass(frozen=True)
class ChatSpec:
    num_conversations: int = 24
    num_turns: int = 4
    system_len: int = 256
    num_systems: int = 4
    user_len: int = 64
    output_len: int = 32
    concurrency: int = 4
    seed: int = 0
    vocab_size: int = 32000
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if min(self.num_conversations, self.num_turns, self.num_systems, self.user_len,
               self.output_len, self.concurrency) < 1:
            raise ValueError("--conversations, --turns, --num-systems, --user-len, "
                             "--output-len and --concurrency must be at least 1")
        if self.system_len < 0:
            raise ValueError(f"--system-len must be >= 0, got {self.system_len}")
        if self.num_systems > self.num_conversations:
            raise ValueError(f"--num-systems ({self.num_systems}) is more than there are "
                             f"conversations ({self.num_conversations})")
        if self.context_len > self.max_model_len:
            raise ValueError(f"a conversation grows to {self.context_len} tokens (system + "
                             f"turns x (user + output)), more than the model's context of "
                             f"{self.max_model_len}; use fewer turns or shorter messages")

    @property
    def context_len(self) -> int:
        """A conversation's tokens after its last reply."""
        return self.system_len + self.num_turns * (self.user_len + self.output_len)

    def to_dict(self) -> dict:
        return asdict(self) | {"context_len": self.context_len}


@dataclass(frozen=True)
class Conversations:
    """One repetition's token ids: system prompts and every user message."""

    systems: list[list[int]]
    users: list[list[list[int]]]  # [conversation][turn]

    @classmethod
    def draw(cls, spec: ChatSpec, rep: int) -> Conversations:
        rng = np.random.default_rng([spec.seed, 3, rep])
        systems = [rng.integers(0, spec.vocab_size, size=spec.system_len).tolist()
                   for _ in range(spec.num_systems)]
        users = [[rng.integers(0, spec.vocab_size, size=spec.user_len).tolist()
                  for _ in range(spec.num_turns)] for _ in range(spec.num_conversations)]
        return cls(systems, users)

    def system_of(self, conversation: int) -> list[int]:
        return self.systems[conversation % len(self.systems)]


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_len: int
    output_ids: list[int]
    ttft_s: float
    e2e_s: float


@dataclass
class ChatRun:
    elapsed_s: float
    turns: list[Turn]  # in the order they were sent
    server: dict[str, float] = field(default_factory=dict)  # SERVER_COUNTERS deltas

    def replies(self) -> dict[tuple[int, int], list[int]]:
        return {(t.conversation, t.turn): t.output_ids for t in self.turns}


async def _converse(address: str, spec: ChatSpec, talk: Conversations) -> ChatRun:
    """All conversations of `talk`, turns round-robin, `spec.concurrency` in flight."""
    from client.aio import AsyncFolioClient

    histories = [list(talk.system_of(c)) for c in range(spec.num_conversations)]
    done = {(c, t): asyncio.Event() for c in range(spec.num_conversations)
            for t in range(spec.num_turns)}
    order = asyncio.Queue()
    for t in range(spec.num_turns):
        for c in range(spec.num_conversations):
            order.put_nowait((c, t))
    turns: list[Turn] = []

    async def speaker(client) -> None:
        while not order.empty():
            c, t = order.get_nowait()
            if t:
                await done[(c, t - 1)].wait()  # its previous reply is part of this prompt
            prompt = histories[c] + talk.users[c][t]
            sent = time.perf_counter()
            first, output = None, []
            async for resp in client.generate(token_ids=prompt, max_tokens=spec.output_len,
                                              temperature=0.0, ignore_eos=True):
                if resp.token_ids:
                    first = first or time.perf_counter()
                    output.extend(resp.token_ids)
            if first is None:
                raise RuntimeError(f"Folio returned no token for turn {t} of conversation {c}")
            turns.append(Turn(c, t, len(prompt), output, first - sent,
                              time.perf_counter() - sent))
            histories[c] = prompt + output
            done[(c, t)].set()

    async with AsyncFolioClient(address, timeout=600) as client:
        before = await client.stats()
        start = time.perf_counter()
        await asyncio.gather(*(speaker(client) for _ in range(spec.concurrency)))
        elapsed = time.perf_counter() - start
        after = await client.stats()
    server = {name: float(after.get(key, 0) - before.get(key, 0))
              for key, name in SERVER_COUNTERS}
    return ChatRun(elapsed, turns, server)


def run_chat(peer: FolioPeer, spec: ChatSpec, talk: Conversations) -> ChatRun:
    return asyncio.run(_converse(peer.address, spec, talk))


def summarize(run: ChatRun) -> dict[str, float]:
    """One run's report rows."""
    s = run.server
    firsts = [t.ttft_s for t in run.turns if t.turn == 0]
    laters = [t.ttft_s for t in run.turns if t.turn > 0]
    num_prompt = sum(t.prompt_len for t in run.turns)
    out = {
        "prompt tokens": float(num_prompt),
        "prefill tokens computed": s["computed"],
        "prefill saved (%)": 100.0 * s["hits"] / num_prompt,
        "prefix hits, device (tokens)": s["hits"] - s["host_hits"],
        "prefix hits, host tier (tokens)": s["host_hits"],
        "TTFT first turns p50 (ms)": 1e3 * percentile(firsts, 50),
    }
    if laters:
        out["TTFT later turns p50 (ms)"] = 1e3 * percentile(laters, 50)
        out["TTFT later turns p90 (ms)"] = 1e3 * percentile(laters, 90)
    num_output = sum(len(t.output_ids) for t in run.turns)
    return out | {
        "turn e2e p50 (ms)": 1e3 * percentile([t.e2e_s for t in run.turns], 50),
        "output tok/s": num_output / run.elapsed_s,
        "elapsed (s)": run.elapsed_s,
        "preemptions": s["preemptions"],
        "output tokens": float(num_output),
    }


def same_replies(run: ChatRun, reference: ChatRun) -> float:
    """Percent of turns whose reply equals the reference run's (same conversations)."""
    ref = reference.replies()
    mine = run.replies()
    return 100.0 * sum(mine[k] == ref[k] for k in ref) / len(ref)


def serve_args(name: str, args) -> list[str]:
    """`folio serve` arguments of a column, beside what every column gets."""
    if name == "folio-host-tier":
        return ["--kv-offloading-size", f"{args.tier_gib:g}"]
    if name == "folio-no-prefix-cache":
        return ["--no-prefix-caching"]
    return []


def device_blocks(spec: ChatSpec) -> int:
    """The default device pool: every system prompt once, and 1.5 times what the conversations
    in flight hold at their longest; far less than all conversations hold once spoken."""
    def blocks(n: int) -> int:
        return -(-n // BLOCK_SIZE)
    return (spec.num_systems * blocks(spec.system_len)
            + blocks(3 * spec.concurrency * (spec.context_len - spec.system_len) // 2))


def make_peer(name: str, args, folio_model: str, max_model_len: int, num_blocks: int,
              log_dir: Path) -> FolioPeer:
    common = ["--dtype", args.dtype, "--max-model-len", str(max_model_len),
              "--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(num_blocks)]
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    peer = FolioPeer(folio_model, [*common, *serve_args(name, args), *args.serve_arg], env,
                     log_dir / name)
    peer.name = name
    return peer


def parse_chat_peers(text: str | None) -> list[str]:
    peers = [x.strip() for x in (text or ",".join(DEFAULT_CHAT_PEERS)).split(",") if x.strip()]
    unknown = [x for x in peers if x not in CHAT_PEERS]
    if unknown or not peers:
        raise SystemExit(f"folio bench: chat mode runs the columns {', '.join(CHAT_PEERS)}; "
                         f"got {text!r}")
    return list(dict.fromkeys(peers))


def default_name(args, model_dir: Path) -> str:
    model = args.random_model or model_dir.name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"chat-{model}-{args.dtype}")


def run(args, peer_names: list[str]) -> int:
    from tqdm import tqdm

    if not args.tier_gib > 0 and "folio-host-tier" in peer_names:
        raise SystemExit("folio bench: --tier-gib must be positive for folio-host-tier")
    if args.kv_blocks is not None and args.kv_blocks < 1:
        raise SystemExit("folio bench: --kv-blocks must be at least 1")
    facts = report.machine_facts()
    folio_model, model_dir = resolve_model(args)
    config = models.read_config(model_dir)
    try:
        spec = ChatSpec(num_conversations=args.conversations, num_turns=args.turns,
                        system_len=args.system_len, num_systems=args.num_systems,
                        user_len=args.user_len, output_len=args.output_len,
                        concurrency=args.concurrency, seed=args.seed,
                        vocab_size=int(config["vocab_size"]),
                        max_model_len=args.max_model_len or models.max_model_len(config))
    except ValueError as e:
        raise SystemExit(f"folio bench: {e}") from None
    max_model_len = args.max_model_len or min(models.max_model_len(config),
                                               max(spec.context_len, 256))
    num_blocks = args.kv_blocks or device_blocks(spec)
    stem = f"{datetime.date.today().isoformat()}-{args.name or default_name(args, model_dir)}"
    log_dir = Path(args.out) / f"{stem}-logs"
    warmup = ChatSpec(**(asdict(spec) | {"num_conversations": spec.concurrency,
                                         "num_systems": min(spec.num_systems, spec.concurrency),
                                         "num_turns": min(spec.num_turns, 2),
                                         "seed": spec.seed + WARMUP_SEED_OFFSET}))

    peers: list[FolioPeer] = []
    peer_info, skipped = {}, {}
    per_rep: dict[str, list[dict[str, float]]] = {}
    raw: dict[str, list[dict]] = {}
    progress = tqdm(total=(2 + args.reps) * len(peer_names), desc="folio bench chat",
                    unit="step", file=sys.stderr)
    load_before = os.getloadavg()
    try:
        for name in peer_names:
            progress.set_postfix_str(f"starting {name}")
            peer = make_peer(name, args, folio_model, max_model_len, num_blocks, log_dir)
            try:
                peer_info[name] = peer.start()
                if args.warmup:
                    progress.set_postfix_str(f"warming up {name}")
                    run_chat(peer, warmup, Conversations.draw(warmup, 0))
                peers.append(peer)
            except PeerUnavailable as e:
                skipped[name] = str(e)
            except Exception as e:  # one configuration that fails must not end the benchmark
                skipped[name] = f"failed to start: {str(e)[:2000]}"
            if name in skipped:
                peer.stop()
                progress.total -= args.reps
            progress.update(2)
        load_before = os.getloadavg()
        for rep in range(args.reps):
            talk = Conversations.draw(spec, rep)
            reference = None
            for peer in peers:
                progress.set_postfix_str(f"rep {rep + 1}/{args.reps}: {peer.name}")
                settle()
                with competing_load(args.competing_load):
                    result = run_chat(peer, spec, talk)
                metrics = summarize(result)
                if reference is None:
                    reference = result
                else:
                    metrics[f"same replies as {peers[0].name} (%)"] = same_replies(result,
                                                                                  reference)
                per_rep.setdefault(peer.name, []).append(metrics)
                raw.setdefault(peer.name, []).append({
                    "rep": rep, "elapsed_s": result.elapsed_s, "metrics": metrics,
                    "server": result.server,
                    "turns": [{"conversation": t.conversation, "turn": t.turn,
                               "prompt_len": t.prompt_len, "num_output": len(t.output_ids),
                               "ttft_s": t.ttft_s, "e2e_s": t.e2e_s} for t in result.turns]})
                progress.update(1)
    finally:
        progress.set_postfix_str("stopping peers")
        for peer in peers:
            with contextlib.suppress(Exception):
                peer.stop()
        progress.close()
    load_after = os.getloadavg()

    aggregates: dict[str, dict[str, Aggregate]] = {n: aggregate(r) for n, r in per_rep.items()}
    result = {
        "mode": "chat", "name": stem, "dtype": args.dtype, "reps": args.reps,
        "competing_load": args.competing_load, "machine": facts,
        "load_before": list(load_before), "load_after": list(load_after),
        "model": models.model_facts(model_dir, folio_model, config, max_model_len),
        "workload": spec.to_dict(),
        "pools": {"block_size": BLOCK_SIZE, "device_blocks": num_blocks,
                  "device_tokens": num_blocks * BLOCK_SIZE,
                  "all_conversations_tokens": spec.num_conversations * spec.context_len,
                  "tier_gib": args.tier_gib if "folio-host-tier" in peer_names else None},
        "settings": {k: v for k, v in vars(args).items() if k != "mode"},
        "peers": peer_info, "skipped": skipped, "runs": raw,
    }
    paths = report.write(Path(args.out), stem, result, aggregates)
    print(paths["md"].read_text())
    if result.get("plot_skipped"):
        print(f"folio bench: {result['plot_skipped']}", file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    differ = [n for n, a in aggregates.items()
              if (s := a.get(f"same replies as {peers[0].name} (%)")) and s.low < 100.0]
    for n in differ:
        print(f"folio bench: {n}'s replies differ from {peers[0].name}'s", file=sys.stderr)
    return 0 if aggregates and not skipped and not differ else 1

