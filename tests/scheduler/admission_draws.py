"""Draws and oracles for the "admission is total" property tests (issue 27):
tests/scheduler/engine/test_admission_properties.py (in process and through the gRPC server, both with
the null model) and tests/e2e/api/test_e2e_admission.py (the real `folio serve`).

- `servers`: a server's shape: SchedulerConfig fields (batch budget, sequence cap, prefix
  caching, preemption mode, overlap, speculation) and the executor's Hello (max_model_len,
  block size, KV pool, swap pool, draft tokens).
- `request_batches`: requests against it: prompt lengths up to and past max_model_len over
  shared prefixes, max_tokens (unset, 0 or set), min_tokens, n, beam search, sampling,
  logprobs and prompt logprobs, stop ids, EOS, stop strings, when each arrives and whether its
  client aborts it.
- `expected_refusal`: whether admission must refuse a request, from the documented limits
  alone (scheduler_svc/api/inputs.py), so "refused" and "admitted" are both checked.
- `expected_endings`: what each admitted sequence must end with, independent of the scheduler:
  the null model run uninterrupted (`NullModel.continuation`), beam search driven directly on it
  (`BeamSearch`), stop strings found by searching the decoded text.
- `check_outcome`: a request's stream (normalized by `endings_of`) against both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import grpc
from hypothesis import strategies as st

from protos.folio.v1 import generator_pb2 as pb
from protos.plan import Hello, SamplingSpec
from scheduler_svc.api.inputs import submit_params
from scheduler_svc.engine.admission import beam_stop_strings
from scheduler_svc.sched.beam_search import BeamSearch, EarlyStopping
from scheduler_svc.sched.sequence_params import sequence_seed
from scheduler_svc.text.tokenizer import Tokenizer
from tests.scheduler.kv_mirror import NullModel
from tests.scheduler.null_executor import make_hello

# The null model's vocabulary in the tiny tokenizer (tests/fixtures/tiny_model.py): its EOS
# ids (generation_config.json), 'a'..'z', and multi-character tokens ('he', ' t', ...), so stop
# strings also complete across tokens.
EOS_IDS = frozenset({1, 2})
MODEL_VOCAB = (1, 2, *range(68, 94), *range(260, 284))
STOP_STRINGS = ("e", "he", " t", "lo", "zz")
PROMPT_ALPHABET = tuple(range(4, 300))
NUM_PREFIXES = 2
EARLY_STOPPING = {pb.EARLY_STOPPING_HEURISTIC: EarlyStopping.HEURISTIC,
                  pb.EARLY_STOPPING_TRUE: EarlyStopping.TRUE,
                  pb.EARLY_STOPPING_NEVER: EarlyStopping.NEVER}


@dataclass(frozen=True)
class Server:
    config: dict  # SchedulerConfig fields
    hello: Hello
    model: NullModel = NullModel()

    @property
    def max_model_len(self) -> int:
        """The effective limit (ExecutorInfo.from_hello): the model's, the pool's, the cap."""
        cap = self.config.get("max_model_len") or math.inf
        return int(min(self.hello.max_model_len,
                       self.hello.num_kv_blocks * self.hello.block_size, cap))

    @property
    def block_size(self) -> int:
        return self.hello.block_size

    @property
    def num_kv_blocks(self) -> int:
        return self.hello.num_kv_blocks

    @property
    def prefix_caching(self) -> bool:
        return self.config.get("enable_prefix_caching", True)


@st.composite
def servers(draw, max_len: int = 40, max_blocks: int = 24, speculation: bool = True) -> Server:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_kv_blocks = draw(st.integers(max(1, -(-2 // block_size)), max_blocks))
    spec = draw(st.sampled_from([None, "ngram", "draft"] if speculation else [None]))
    k = draw(st.integers(1, 4)) if spec else None
    # A draft executor may offer fewer proposals than asked: speculation is then off.
    num_draft = draw(st.sampled_from([k, k, 0])) if spec == "draft" else 0
    hello = make_hello(max_model_len=draw(st.one_of(st.just(max_len), st.integers(2, max_len))),
                       block_size=block_size,
                       num_kv_blocks=num_kv_blocks, num_swap_blocks=draw(st.integers(0, 16)),
                       num_draft_tokens=num_draft)
    config = dict(
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.one_of(st.integers(1, 8), st.integers(9, 64))),
        max_model_len=draw(st.sampled_from([None, None, None, draw(st.integers(2, max_len))])),
        enable_prefix_caching=draw(st.booleans()),
        preemption_mode=draw(st.sampled_from(["auto", "recompute", "swap"])),
        overlap_scheduling=draw(st.booleans()),
        speculative_method=spec, num_speculative_tokens=k)
    # Context 1: greedy runs soon loop, so n-gram and draft proposals are accepted; None:
    # they mostly are not.
    return Server(config, hello, NullModel(MODEL_VOCAB, draw(st.sampled_from([1, None]))))


def prefix(k: int, alphabet: tuple[int, ...]) -> list[int]:
    """Shared prompt prefix k (long enough for any prompt drawn)."""
    return [alphabet[(k * 101 + i * 37) % len(alphabet)] for i in range(512)]


@dataclass(frozen=True)
class Drawn:
    """One drawn request: its public fields, and when it arrives (loop turns after the
    start) and is aborted by its client (turns after it arrived; None: never)."""

    req_id: str
    prompt: list[int]
    max_tokens: int = 0  # 0 = unset (the rest of the context)
    min_tokens: int = 0
    n: int = 1
    beam_width: int = 1
    early_stopping: int = pb.EARLY_STOPPING_HEURISTIC
    length_penalty: float = 1.0
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # top alternatives per token (0: the token's own only)
    prompt_logprobs: int | None = None
    delay: int = 0
    abort_after: int | None = None

    def message(self) -> pb.GenerateRequest:
        sampling = pb.SamplingParams(
            max_tokens=self.max_tokens, min_tokens=self.min_tokens, n=self.n,
            temperature=self.temperature, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, stop=self.stop)
        if self.beam_width > 1:
            sampling.beam_width = self.beam_width
            sampling.early_stopping = self.early_stopping
            sampling.length_penalty = self.length_penalty
        if self.seed is not None:
            sampling.seed = self.seed
        if self.logprobs is not None:
            sampling.logprobs = self.logprobs
        if self.prompt_logprobs is not None:
            sampling.prompt_logprobs = self.prompt_logprobs
        return pb.GenerateRequest(request_id=self.req_id, token_ids=pb.TokenIds(ids=self.prompt),
                                  sampling=sampling)

    @property
    def num_sequences(self) -> int:
        return max(self.n, self.beam_width)


@st.composite
def drawn_requests(draw, req_id: str, max_model_len: int, *, alphabet=PROMPT_ALPHABET,
                   stop_ids=MODEL_VOCAB, stop_strings=STOP_STRINGS, max_n: int = 4,
                   max_beam_width: int = 4, max_delay: int = 12, abort: bool = True,
                   logprobs: bool = True) -> Drawn:
    # Lengths at the limit are drawn as often as any other length, and short prompts (room
    # to decode) as often again.
    length = draw(st.one_of(st.sampled_from([1, max_model_len - 1, max_model_len,
                                             max_model_len + 1]),
                            st.integers(1, max_model_len + 1),
                            st.integers(1, max(1, max_model_len // 3))).filter(lambda n: n >= 1))
    shared = draw(st.one_of(st.just(length), st.integers(0, length)))  # prefix-cache hits
    start = draw(st.integers(0, len(alphabet) - 1))
    prompt = prefix(draw(st.integers(0, NUM_PREFIXES - 1)), alphabet)[:shared] + \
        [alphabet[(start + 7 * i) % len(alphabet)] for i in range(length - shared)]
    beam_width = draw(st.sampled_from([1] * 5 + [2, 3, max_beam_width]))
    n = draw(st.integers(1, beam_width)) if beam_width > 1 else \
        draw(st.sampled_from([1, 1, 1, 2, max_n]))
    if beam_width > 1 and draw(st.integers(0, 9)) == 0:
        n = beam_width + 1  # refused: a search returns at most beam_width sequences
    return Drawn(
        req_id=req_id, prompt=prompt,
        max_tokens=draw(st.one_of(st.just(0), st.integers(1, 3), st.integers(4, 40))),
        min_tokens=draw(st.sampled_from([0, 0, 0, draw(st.integers(1, 8))])),
        n=n, beam_width=beam_width,
        early_stopping=draw(st.sampled_from(sorted(EARLY_STOPPING))),
        length_penalty=draw(st.sampled_from([1.0, 0.5, -1.0])),
        temperature=draw(st.sampled_from([0.0, 0.0, 1.0])),
        seed=draw(st.one_of(st.none(), st.integers(0, 1000))),
        stop_token_ids=tuple(draw(st.lists(st.sampled_from(stop_ids), max_size=2,
                                           unique=True))),
        ignore_eos=draw(st.booleans()),
        stop=tuple(draw(st.lists(st.sampled_from(stop_strings), max_size=2, unique=True)))
        if stop_strings and draw(st.integers(0, 3)) == 0 else (),
        logprobs=draw(st.sampled_from([None] * 5 + [0, 3])) if logprobs else None,
        prompt_logprobs=draw(st.sampled_from([None] * 5 + [0, 2])) if logprobs else None,
        delay=draw(st.integers(0, max_delay)),
        abort_after=draw(st.integers(0, 30)) if abort and draw(st.integers(0, 7)) == 0
        else None)


def request_batches(max_model_len: int, min_size: int = 1, max_size: int = 6, **kwargs
                    ) -> st.SearchStrategy[list[Drawn]]:
    return st.integers(min_size, max_size).flatmap(lambda num: st.tuples(*(
        drawn_requests(f"r{i}", max_model_len, **kwargs) for i in range(num))).map(list))


# ---- the oracle ----------------------------------------------------------------------------

def capped_max_tokens(req: Drawn, max_model_len: int) -> int:
    """check_for_executor's cap: the rest of the context, at least one token."""
    cap = max(1, max_model_len - len(req.prompt))
    return min(cap, req.max_tokens) if req.max_tokens else cap


def expected_refusal(req: Drawn, max_model_len: int, block_size: int, num_kv_blocks: int
                     ) -> str | None:
    """A fragment of the message admission must refuse `req` with, or None if it must admit
    it: the first limit it breaks, in the order the server checks them."""
    if req.beam_width > 1 and (req.logprobs is not None or req.prompt_logprobs is not None):
        return "logprobs and prompt_logprobs are not supported with beam search"
    if req.beam_width > 1 and req.n > req.beam_width:
        return "beam search returns at most beam_width sequences"
    if req.max_tokens and req.min_tokens > req.max_tokens:
        return f"min_tokens ({req.min_tokens}) may not exceed max_tokens"
    if req.beam_width > 1 and req.min_tokens:
        return "beam search (beam_width > 1) does not support min_tokens"
    if len(req.prompt) > max_model_len:
        return f"prompt has {len(req.prompt)} tokens but max_model_len is {max_model_len}"
    if req.beam_width > 1:
        # The prompt's blocks, and per beam the KV of every generated token but the last
        # (never computed) plus one copied block; with one token, nothing past the prompt.
        num_written = capped_max_tokens(req, max_model_len) - 1
        need = -(-len(req.prompt) // block_size) + (
            req.beam_width * (-(-num_written // block_size) + 1) if num_written else 0)
        if need > num_kv_blocks:
            return f"may need {need} KV blocks, but the pool has {num_kv_blocks}"
    return None


@dataclass(frozen=True)
class Ending:
    """One sequence of a stream, as the client saw it."""

    token_ids: list[int]
    text: str
    finish: str  # stop | length | abort
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    matched: int | str | None = None
    # (token id, logprob, rank, top ids, top logprobs) per token, and per prompt token after
    # the first (index 0's first message): [] when not asked for.
    logprobs: list[tuple] = field(default_factory=list)
    prompt_logprobs: list[tuple] = field(default_factory=list)


@dataclass(frozen=True)
class Refused:
    code: grpc.StatusCode
    message: str


@dataclass
class Expected:
    token_ids: list[int]
    finish: str
    matched: int | str | None = None
    text: str | None = None  # None: not checked (beams: none is streamed before the end)
    logprobs: list[tuple] = field(default_factory=list)
    prompt_logprobs: list[tuple] = field(default_factory=list)


def sampling_of(req: Drawn) -> SamplingSpec:
    """The request's SamplingSpec as the server builds it (inputs.submit_params)."""
    return submit_params(req.message()).sampling


def _stop_string_cut(tokens: list[int], req: Drawn, tokenizer: Tokenizer, stopped_by_id: bool
                     ) -> tuple[int, str, str] | None:
    """(tokens kept, text shown, stop string) where the first stop string ends in the text of
    an output token after the first min_tokens (the text of a stop id is never searched), or
    None. At one token, the match that ends first wins, then the longest."""
    searched = len(tokens) - 1 if stopped_by_id else len(tokens)
    before = tokenizer.decode([])
    for j in range(1, searched + 1):
        text = tokenizer.decode(tokens[:j])
        if j > req.min_tokens:
            found = [(start + len(s), -len(s), start, s) for s in req.stop
                     for start in range(len(text) - len(s) + 1)
                     if text.startswith(s, start) and start + len(s) > len(before)]
            if found:
                _, _, start, s = min(found)
                return j, text[:start], s
        before = text
    return None


def expected_endings(req: Drawn, server: Server, tokenizer: Tokenizer) -> list[Expected]:
    """What each of the request's sequences must end with when nothing interrupts it."""
    max_tokens = capped_max_tokens(req, server.max_model_len)
    stops = frozenset(req.stop_token_ids) | (frozenset() if req.ignore_eos else EOS_IDS)
    if req.beam_width > 1:
        return _expected_beams(req, server, tokenizer, max_tokens, stops)
    spec = sampling_of(req)
    if req.min_tokens and stops:
        spec = replace(spec, min_tokens_stop_ids=tuple(sorted(stops)))
    out = []
    for i in range(req.n):
        tokens = server.model.continuation(
            req.prompt, replace(spec, seed=sequence_seed(spec.seed, i)), max_tokens, stops,
            req.min_tokens)
        by_id = tokens[-1] in stops and len(tokens) >= req.min_tokens
        cut = _stop_string_cut(tokens, req, tokenizer, by_id) if req.stop else None
        if cut is not None:
            j, text, s = cut
            want = Expected(tokens[:j], "stop", s, text)
        elif by_id:
            want = Expected(tokens, "stop", tokens[-1], tokenizer.decode(tokens[:-1]))
        else:
            want = Expected(tokens, "length", None, tokenizer.decode(tokens))
        if req.logprobs is not None:
            want.logprobs = [_logprob_entry(server.model, req.prompt + want.token_ids[:j], t,
                                            req.logprobs)
                             for j, t in enumerate(want.token_ids)]
        if req.prompt_logprobs is not None and i == 0:
            want.prompt_logprobs = [_logprob_entry(server.model, req.prompt[:j], req.prompt[j],
                                                   req.prompt_logprobs)
                                    for j in range(1, len(req.prompt))]
        out.append(want)
    return out


def _logprob_entry(model: NullModel, context: list[int], token_id: int, k: int) -> tuple:
    top = model.logprobs(context)[:k]
    return (token_id, *model.token_logprob(context, token_id), tuple(t for t, _ in top),
            tuple(v for _, v in top))


def _expected_beams(req: Drawn, server: Server, tokenizer: Tokenizer, max_tokens: int,
                    stops: frozenset[int]) -> list[Expected]:
    params = submit_params(req.message())
    search = BeamSearch(req.beam_width, max_tokens, stops, req.length_penalty,
                        EARLY_STOPPING[req.early_stopping], beam_stop_strings(params, tokenizer))
    while not search.done:
        search.step([server.model.logprobs(req.prompt + b.token_ids)[:search.num_candidates]
                     for b in search.beams])
    out = []
    for hyp in search.best(req.n):
        matched = None
        if hyp.stopped:
            matched = hyp.stop_str if hyp.stop_str is not None else hyp.token_ids[-1]
        out.append(Expected(list(hyp.token_ids), "stop" if hyp.stopped else "length", matched))
    # Fewer hypotheses than n only with a vocabulary smaller than 2 * beam_width.
    return out + [Expected([], "length") for _ in range(req.n - len(out))]


# ---- streams, normalized -------------------------------------------------------------------

FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                pb.FINISH_REASON_ABORT: "abort"}


def endings_of(messages: list[tuple]) -> dict[int, Ending]:
    """Each index's ending from a stream's messages, given as (index, token_ids, text,
    finish or None, (prompt, completion, cached) usage, matched, token logprobs, prompt
    logprobs); checks that every index has exactly one final message, its last."""
    endings: dict[int, Ending] = {}
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    lps: dict[int, list[tuple]] = {}
    prompt_lps: dict[int, list[tuple]] = {}
    for index, token_ids, text, finish, usage, matched, token_lps, prompt in messages:
        assert index not in endings, f"index {index} got a message after its final one"
        tokens.setdefault(index, []).extend(token_ids)
        texts[index] = texts.get(index, "") + text
        lps.setdefault(index, []).extend(token_lps)
        prompt_lps.setdefault(index, []).extend(prompt)
        if finish is not None:
            endings[index] = Ending(tokens[index], texts[index], finish, *usage, matched,
                                    lps[index], prompt_lps[index])
    assert set(tokens) == set(endings), f"indexes {set(tokens) - set(endings)} never ended"
    return endings


def response_messages(responses: list[pb.GenerateResponse]) -> list[tuple]:
    out = []
    for r in responses:
        finish = FINISH_NAMES[r.finish_reason] if r.finish_reason else None
        which = r.WhichOneof("matched_stop")
        matched = getattr(r, which) if which else None
        out.append((r.index, list(r.token_ids), r.text, finish,
                    (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_tokens),
                    matched, [_pb_entry(t) for t in r.logprobs],
                    [_pb_entry(t) for t in r.prompt_logprobs]))
    return out


def _pb_entry(t: pb.TokenLogprobs) -> tuple:
    return (t.token_id, t.logprob, t.rank, tuple(a.token_id for a in t.top_logprobs),
            tuple(a.logprob for a in t.top_logprobs))


def output_entries(entries) -> list[tuple]:
    """RequestOutput's TokenLogprobs (or None) as Ending's tuples."""
    return [(t.token_id, t.logprob, t.rank, tuple(t.top_ids), tuple(t.top_logprobs))
            for t in entries or ()]


def check_outcome(req: Drawn, server: Server, outcome: Refused | dict[int, Ending],
                  expected: list[Expected] | None, aborted: bool,
                  eos_ids: frozenset[int] = EOS_IDS) -> None:
    """`req`'s stream against the oracle: refused iff a limit says so, with INVALID_ARGUMENT
    and that limit's message; otherwise n sequences, each ended once with a finish reason and
    a usage that adds up, and (with `expected`) the tokens, text and finish of an
    uninterrupted run; an aborted request's unfinished sequences end with ABORT on a prefix."""
    mml = server.max_model_len
    refusal = expected_refusal(req, mml, server.block_size, server.num_kv_blocks)
    if isinstance(outcome, Refused):
        assert refusal is not None, f"{req.req_id} refused: {outcome}"
        assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
        assert refusal in outcome.message, (refusal, outcome.message)
        return
    assert refusal is None, f"{req.req_id} admitted, but must be refused: {refusal}"
    assert sorted(outcome) == list(range(req.n)), f"{req.req_id}: indexes {sorted(outcome)}"
    num_prompt, max_tokens = len(req.prompt), capped_max_tokens(req, mml)
    for index, end in outcome.items():
        where = f"{req.req_id}/{index}"
        assert end.prompt_tokens == num_prompt, where
        assert end.completion_tokens == len(end.token_ids) <= max_tokens, (where, end)
        assert num_prompt + end.completion_tokens <= max(mml, num_prompt + 1), (where, end)
        assert 0 <= end.cached_tokens <= max(0, num_prompt - 1), (where, end)
        assert end.cached_tokens % server.block_size == 0, (where, end)
        if not server.prefix_caching:
            assert end.cached_tokens == 0, (where, end)
        if end.finish == "abort":
            assert aborted, f"{where} aborted, but its client never aborted it"
        elif end.finish == "stop" and isinstance(end.matched, int):
            stops = set(req.stop_token_ids) | (set() if req.ignore_eos else eos_ids)
            assert end.matched in stops and end.token_ids[-1] == end.matched, (where, end)
            assert end.completion_tokens >= req.min_tokens, (where, end)
        elif end.finish == "stop":
            assert end.matched in req.stop, (where, end)
        else:
            assert end.finish == "length", (where, end)
            # (A beam search may end its hypotheses early: beam_search.py.)
            assert req.beam_width > 1 or end.completion_tokens == max_tokens or \
                num_prompt + end.completion_tokens >= mml, (where, end)
        _check_logprobs_shape(req, index, end, where)
        if expected is None:
            continue
        want = expected[index]
        if end.finish == "abort":
            assert end.token_ids == want.token_ids[:len(end.token_ids)], (where, end, want)
            assert end.logprobs == want.logprobs[:len(end.logprobs)], (where, end, want)
            assert end.prompt_logprobs in ([], want.prompt_logprobs), (where, end, want)
            continue
        assert (end.token_ids, end.finish, end.matched) == \
            (want.token_ids, want.finish, want.matched), (where, end, want)
        if want.text is not None:
            assert end.text == want.text, (where, end, want)
        assert end.logprobs == want.logprobs, (where, end, want)
        assert end.prompt_logprobs == want.prompt_logprobs, (where, end, want)


def _check_logprobs_shape(req: Drawn, index: int, end: Ending, where: str) -> None:
    """Logprobs as asked, whatever the model: one entry per token (each for that token, with
    its k alternatives); index 0's prompt logprobs one per prompt token after the first,
    unless the sequence was aborted before its first message."""
    if req.logprobs is None:
        assert end.logprobs == [], (where, end)
    else:
        assert [e[0] for e in end.logprobs] == end.token_ids, (where, end)
        assert all(e[2] >= 1 and len(e[3]) == req.logprobs for e in end.logprobs), (where, end)
    if req.prompt_logprobs is None or index != 0:
        assert end.prompt_logprobs == [], (where, end)
    elif end.prompt_logprobs or end.finish != "abort":
        assert [e[0] for e in end.prompt_logprobs] == req.prompt[1:], (where, end)
        assert all(len(e[3]) == req.prompt_logprobs for e in end.prompt_logprobs), (where, end)
