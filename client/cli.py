"""The `folio` command: run the services, or talk to a running server.

    folio serve [--model DIR] ...      scheduler + spawned executor (one command)
    folio scheduler ... / folio executor ...   the two processes separately (compose)
    folio generate "Once upon a time" --max-tokens 32      streams text as it arrives
    folio info | folio stats | folio health
    folio keygen PATH                  a channel secret for --channel-secret-file
    folio bench throughput|latency|serve|context ...   Folio side by side with vLLM and HF (client/bench)
    ... --api-key KEY (or FOLIO_API_KEY) --tls-ca server.pem    a server with auth and TLS

Service modules are imported inside their subcommands: `folio generate` never loads torch, and
`folio serve`/`folio scheduler` load only the scheduler (the executor is a separate process).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The API's own default (max_tokens unset or 0) is the rest of the context; a command-line
# answer should end sooner. `--max-tokens 0` asks for the API's default.
DEFAULT_MAX_TOKENS = 256
SERVICE_COMMANDS = {
    "serve": "scheduler and executor together (the executor is spawned as a child process)",
    "scheduler": "the scheduler alone: gRPC API + ZeroMQ endpoint executors connect to",
    "executor": "an executor that connects to a running scheduler",
}


def run_service(command: str, argv: list[str]) -> int:
    if command == "executor":
        from executor_svc.cli import main as executor_main

        return executor_main(argv)
    from scheduler_svc.cli import main as scheduler_main

    return scheduler_main(argv, spawn_executor=command == "serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="folio", description="Folio LLM inference server.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in SERVICE_COMMANDS.items():
        # Parsed by the service itself (run_service); listed here for `folio --help`.
        sub.add_parser(name, help=help_text, add_help=False)
    sub.add_parser("bench", help="benchmark Folio against vLLM and HF transformers on one "
                   "workload (see `folio bench --help`)", add_help=False)

    def client_parser(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--address", default="127.0.0.1:50051", help="server host:port")
        p.add_argument("--timeout", type=float, default=None, help="deadline per call, seconds")
        p.add_argument("--wait-ready", type=float, default=0.0, metavar="SECONDS",
                       help="first wait up to SECONDS for the server to report SERVING")
        p.add_argument("--api-key", default=None,
                       help="API key of a server started with --api-key (default: the "
                       "FOLIO_API_KEY environment variable)")
        p.add_argument("--tls", action="store_true",
                       help="connect over TLS, trusting the system's root certificates")
        p.add_argument("--tls-ca", default=None, metavar="PEM",
                       help="connect over TLS, trusting this CA (or the server's self-signed "
                       "certificate)")
        return p

    gen = client_parser("generate", "stream a completion to stdout")
    gen.add_argument("prompt", nargs="?", default=None, help="prompt text ('-' reads stdin)")
    gen.add_argument("--token-ids", default=None, help="comma-separated prompt token ids")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat turn")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                     help=f"most tokens to generate per sequence (default {DEFAULT_MAX_TOKENS}; "
                          "0 = no limit below the model's max_model_len)")
    gen.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop-token-ids", default="", help="comma-separated ids")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--n", type=int, default=None, help="number of sequences to return")
    gen.add_argument("--beam-width", type=int, default=None, help="beam search when > 1")
    gen.add_argument("--length-penalty", type=float, default=None, help="beam search only")
    gen.add_argument("--early-stopping", default="heuristic",
                     choices=["heuristic", "true", "never"], help="beam search only")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop when the text contains TEXT (repeatable; TEXT is cut off)")
    gen.add_argument("--include-stop-str-in-output", action="store_true",
                     help="keep the matched stop string (or stop token's text) in the output")
    gen.add_argument("--keep-special-tokens", action="store_true",
                     help="show special tokens (<|im_end|>, ...) in the text")
    gen.add_argument("--no-spaces-between-special-tokens", action="store_true",
                     help="with --keep-special-tokens: no separator between adjacent added "
                          "tokens (only matters for tokenizers whose decoder puts one)")
    gen.add_argument("--min-tokens", type=int, default=None,
                     help="no EOS or stop token before this many tokens")
    gen.add_argument("--repetition-penalty", type=float, default=None,
                     help="> 0, 1 = off (HF: over prompt and output)")
    gen.add_argument("--presence-penalty", type=float, default=None,
                     help="[-2, 2] (OpenAI: over the output)")
    gen.add_argument("--frequency-penalty", type=float, default=None,
                     help="[-2, 2] (OpenAI: over the output)")
    gen.add_argument("--min-p", type=float, default=None, help="[0, 1], 0 = off")
    gen.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                     help="add BIAS ([-100, 100]) to token ID's logit; repeatable")
    gen.add_argument("--allowed-token-ids", default="",
                     help="comma-separated ids: only these may be sampled")
    gen.add_argument("--bad-words", action="append", default=[], metavar="WORD",
                     help="a word never generated; repeatable")
    structured = gen.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                            help="the output is JSON valid under this schema (a file holding "
                                 "it, or the schema's JSON text)")
    structured.add_argument("--json-object", action="store_true",
                            help="the output is one JSON object")
    structured.add_argument("--regex", default=None, help="the output fully matches REGEX")
    structured.add_argument("--grammar", default=None, metavar="FILE",
                            help="the output is a sentence of this GBNF (or Lark) grammar")
    structured.add_argument("--choice", action="append", default=None, metavar="TEXT",
                            help="the output is exactly one of the TEXTs (repeatable)")
    gen.add_argument("--logprobs", type=int, default=None, metavar="K",
                     help="each token's logprob and rank plus K alternatives (0..20; in --json)")
    gen.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                     help="each prompt token's logprob and rank plus K alternatives (0..20; "
                          "in --json)")
    gen.add_argument("--logprobs-mode", choices=["raw", "processed"], default="raw",
                     help="--logprobs of the model's distribution (raw) or of the one each "
                          "token was drawn from, after penalties, temperature, top-k/p "
                          "(processed)")
    gen.add_argument("--request-id", default="")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (token_ids, text, finish_reason, "
                          "matched_stop, usage, request_id; with several sequences, a "
                          "`choices` list of those) instead of streaming text")

    keygen = sub.add_parser("keygen", help="write a random executor-channel secret to a file "
                            "(kept if it exists) for --channel-secret-file")
    keygen.add_argument("path", help="where the secret goes (created with mode 0600)")
    client_parser("info", "print the served model's facts as JSON")
    client_parser("stats", "print the server's counters as JSON")
    client_parser("health", "print the health status; exit 0 only when SERVING")
    return parser


def _ids(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise SystemExit(f"folio: {flag} takes comma-separated integers, got {text!r}") from None


def _logit_bias(entries: list[str]) -> dict[int, float]:
    bias = {}
    for entry in entries:
        token_id, sep, value = entry.partition("=")
        try:
            bias[int(token_id)] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise SystemExit(f"folio: --logit-bias takes ID=BIAS (e.g. 42=-100), got {entry!r}")
    return bias


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"folio: cannot read {flag} {path}: {e}") from None


def structured_kwargs(args: argparse.Namespace) -> dict:
    """--json-schema (a file, or JSON text when it is not a file), --json-object, --regex,
    --grammar FILE, --choice: at most one (argparse refuses two)."""
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{") and Path(text).is_file():
            text = _read(text, "--json-schema")
        return {"json_schema": text}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.grammar is not None:
        return {"grammar": _read(args.grammar, "--grammar")}
    if args.choice is not None:
        return {"choice": args.choice}
    return {}


def generate_kwargs(args: argparse.Namespace) -> dict:
    """The FolioClient.generate arguments for `folio generate`'s flags."""
    kwargs = dict(max_tokens=args.max_tokens or None, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos,
                  stop_token_ids=_ids(args.stop_token_ids, "--stop-token-ids"),
                  request_id=args.request_id, n=args.n, beam_width=args.beam_width,
                  length_penalty=args.length_penalty, early_stopping=args.early_stopping,
                  stop=args.stop, include_stop_str_in_output=args.include_stop_str_in_output,
                  skip_special_tokens=False if args.keep_special_tokens else None,
                  spaces_between_special_tokens=(False if args.no_spaces_between_special_tokens
                                                 else None),
                  min_tokens=args.min_tokens, repetition_penalty=args.repetition_penalty,
                  presence_penalty=args.presence_penalty,
                  frequency_penalty=args.frequency_penalty, min_p=args.min_p,
                  logit_bias=_logit_bias(args.logit_bias),
                  allowed_token_ids=_ids(args.allowed_token_ids, "--allowed-token-ids"),
                  bad_words=args.bad_words,
                  logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs,
                  logprobs_mode=args.logprobs_mode)
    kwargs.update(structured_kwargs(args))
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.token_ids is not None:
        if prompt is not None or args.chat:
            raise SystemExit("folio: give either a PROMPT or --token-ids, not both")
        return {**kwargs, "token_ids": _ids(args.token_ids, "--token-ids")}
    if prompt is None:
        raise SystemExit("folio: generate needs a PROMPT (or --token-ids)")
    if args.chat:
        messages = [("system", args.system)] if args.system is not None else []
        return {**kwargs, "messages": [*messages, ("user", prompt)]}
    return {**kwargs, "prompt": prompt}


def run_generate(client, args: argparse.Namespace) -> int:
    from client.messages import Choices, Completion

    kwargs = generate_kwargs(args)
    # One sequence streams its text as it arrives; several (n > 1, or beam search, whose beams
    # arrive at the end) are printed one after another once each finishes.
    several = (args.n or 1) > 1 or (args.beam_width or 1) > 1
    choices = Choices()
    stream = client.generate(**kwargs)
    try:
        for resp in stream:
            completion = choices.add(resp)
            if args.json:
                continue
            if not several and resp.text:
                sys.stdout.write(resp.text)
                sys.stdout.flush()
            elif several and completion.finish_reason is not None:
                print(f"[{completion.index}] {completion.text}")
    except KeyboardInterrupt:
        stream.cancel()  # the server aborts the request and frees its blocks
        print(file=sys.stderr)
        return 130
    completions = choices.completions
    if args.json:
        if several:
            out = {"request_id": completions[0].request_id if completions else "",
                   "choices": [c.to_dict() for c in completions]}
        else:
            out = (completions[0] if completions else Completion()).to_dict()
        print(json.dumps(out, ensure_ascii=False))
    elif not several:
        sys.stdout.write("\n")
    if any(c.finish_reason == "abort" for c in completions):
        print("folio: the server aborted the request", file=sys.stderr)
        return 1
    return 0


def run_client(args: argparse.Namespace) -> int:
    import grpc

    from client.api import FolioClient

    try:
        client = FolioClient(args.address, timeout=args.timeout, api_key=args.api_key,
                             tls=args.tls, tls_ca=args.tls_ca)
    except OSError as e:  # an unreadable --tls-ca
        print(f"folio: cannot read --tls-ca: {e}", file=sys.stderr)
        return 1
    with client:
        try:
            if args.wait_ready > 0:
                client.wait_ready(args.wait_ready)
            match args.command:
                case "generate":
                    return run_generate(client, args)
                case "info":
                    print(json.dumps(client.model_info(), indent=2))
                case "stats":
                    print(json.dumps(client.stats(), indent=2))
                case "health":
                    status = client.health()
                    print(status)
                    return 0 if status == "SERVING" else 1
        except grpc.RpcError as e:
            print(f"folio: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except TimeoutError as e:
            print(f"folio: {e}", file=sys.stderr)
            return 1
    return 0


def run_keygen(path: str) -> int:
    """A fresh secret, readable by its owner only; an existing file is left as it is, so
    every service of a deployment can run this at start and all of them share one secret.
    The secret is written to a temporary file and linked into place (link fails if the path
    exists), so a service racing another never reads a half-written file."""
    import os
    import tempfile

    from protos.channel_keys import generate_secret

    if os.path.exists(path):
        print(f"folio: {path} exists; keeping it", file=sys.stderr)
        return 0
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                   prefix=".keygen-")  # mode 0600
    except OSError as e:
        print(f"folio: cannot create {path}: {e}", file=sys.stderr)
        return 1
    try:
        with os.fdopen(fd, "w") as f:
            f.write(generate_secret() + "\n")
        os.link(tmp, path)
    except FileExistsError:
        print(f"folio: {path} exists; keeping it", file=sys.stderr)
        return 0
    except OSError as e:
        print(f"folio: cannot create {path}: {e}", file=sys.stderr)
        return 1
    finally:
        os.unlink(tmp)
    print(f"folio: wrote a new channel secret to {path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SERVICE_COMMANDS:
        return run_service(argv[0], argv[1:])
    if argv and argv[0] == "bench":
        from client.bench.cli import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "keygen":
        return run_keygen(args.path)
    return run_client(args)


if __name__ == "__main__":
    sys.exit(main())
