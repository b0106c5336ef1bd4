"""The `folio` command line: argument handling in-process, and the real command (a subprocess)
against a real server on the default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from client.cli import build_parser, generate_kwargs, main
from client.messages import sampling_params
from protos.folio.v1 import generator_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str):
    return build_parser().parse_args(["generate", *argv])


def folio(*argv: str, timeout: float = 120, importtime: bool = False):
    """Run `folio ARGV` as its own process, like the console script does."""
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run([sys.executable, *flags, "-m", "client.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def imported_top_level(importtime_stderr: str) -> set[str]:
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


# ---- argument handling (no server) ---------------------------------------------------------

def test_generate_flags_map_to_client_arguments():
    kwargs = generate_kwargs(parse("Hi", "--max-tokens", "5", "--temperature", "0", "--top-k",
                                   "3", "--stop-token-ids", "7, 9", "--ignore-eos"))
    assert kwargs["prompt"] == "Hi"
    assert (kwargs["max_tokens"], kwargs["temperature"], kwargs["top_k"]) == (5, 0.0, 3)
    assert kwargs["top_p"] is None and kwargs["seed"] is None  # unset: server defaults
    assert kwargs["stop_token_ids"] == [7, 9] and kwargs["ignore_eos"] is True
    assert kwargs["stop"] == [] and kwargs["include_stop_str_in_output"] is False
    assert kwargs["skip_special_tokens"] is None  # unset: the server's default (true)
    assert kwargs["spaces_between_special_tokens"] is None


def test_text_flags_map_to_client_arguments():
    kwargs = generate_kwargs(parse("Hi", "--stop", "\n\n", "--stop", "User:",
                                   "--include-stop-str-in-output", "--keep-special-tokens",
                                   "--no-spaces-between-special-tokens"))
    assert kwargs["stop"] == ["\n\n", "User:"] and kwargs["include_stop_str_in_output"]
    assert kwargs["skip_special_tokens"] is False
    assert kwargs["spaces_between_special_tokens"] is False
    assert generate_kwargs(parse("Hi"))["max_tokens"] == 256  # the CLI's documented default
    kwargs = generate_kwargs(parse("Hi", "--logprobs", "3", "--prompt-logprobs", "0"))
    assert (kwargs["logprobs"], kwargs["prompt_logprobs"]) == (3, 0)
    assert generate_kwargs(parse("Hi"))["logprobs"] is None  # unset: none asked for
    assert generate_kwargs(parse("Hi"))["logprobs_mode"] == "raw"
    processed = generate_kwargs(parse("Hi", "--logprobs", "1", "--logprobs-mode", "processed"))
    assert sampling_params(**{k: processed[k] for k in ("logprobs", "logprobs_mode")}
                           ).logprobs_mode == pb.LOGPROBS_MODE_PROCESSED
    assert generate_kwargs(parse("Hi", "--max-tokens", "0"))["max_tokens"] is None


def test_logits_processor_flags_map_to_client_arguments():
    kwargs = generate_kwargs(parse(
        "Hi", "--min-tokens", "4", "--repetition-penalty", "1.2", "--presence-penalty", "0.5",
        "--frequency-penalty", "-0.5", "--min-p", "0.1", "--logit-bias", "42=-100",
        "--logit-bias", "7=2.5", "--allowed-token-ids", "1,2,42", "--bad-words", "foo",
        "--bad-words", "bar baz"))
    assert (kwargs["min_tokens"], kwargs["repetition_penalty"], kwargs["presence_penalty"],
            kwargs["frequency_penalty"], kwargs["min_p"]) == (4, 1.2, 0.5, -0.5, 0.1)
    assert kwargs["logit_bias"] == {42: -100.0, 7: 2.5}
    assert kwargs["allowed_token_ids"] == [1, 2, 42]
    assert kwargs["bad_words"] == ["foo", "bar baz"]
    unset = generate_kwargs(parse("Hi"))
    assert unset["min_p"] is None and unset["logit_bias"] == {} and unset["bad_words"] == []
    params = sampling_params(**{k: v for k, v in kwargs.items()
                                if k not in ("prompt", "request_id")})
    assert params.min_tokens == 4 and dict(params.logit_bias) == {42: -100.0, 7: 2.5}
    assert list(params.bad_words) == ["foo", "bar baz"] and params.HasField("min_p")
    assert not sampling_params().HasField("repetition_penalty")  # unset: server default


def test_chat_and_token_id_inputs():
    chat = generate_kwargs(parse("Hello", "--chat", "--system", "Be brief."))
    assert chat["messages"] == [("system", "Be brief."), ("user", "Hello")]
    assert "prompt" not in chat
    ids = generate_kwargs(parse("--token-ids", "1,2, 3"))
    assert ids["token_ids"] == [1, 2, 3] and "prompt" not in ids


def test_structured_output_flags(tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    assert json.loads(generate_kwargs(parse("Hi", "--json-schema", str(path)))["json_schema"]) \
        == schema
    assert generate_kwargs(parse("Hi", "--json-schema", '{"type": "array"}'))["json_schema"] \
        == '{"type": "array"}'
    assert generate_kwargs(parse("Hi", "--json-object"))["json_object"] is True
    assert generate_kwargs(parse("Hi", "--regex", "[0-9]+"))["regex"] == "[0-9]+"
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "a"')
    assert generate_kwargs(parse("Hi", "--grammar", str(grammar)))["grammar"] == 'root ::= "a"'
    assert generate_kwargs(parse("Hi", "--choice", "yes", "--choice", "no"))["choice"] == \
        ["yes", "no"]
    plain = generate_kwargs(parse("Hi"))
    assert not {"json_schema", "json_object", "regex", "grammar", "choice"} & plain.keys()
    with pytest.raises(SystemExit):  # argparse: one constraint at most
        parse("Hi", "--regex", "a", "--json-object")
    with pytest.raises(SystemExit) as err:
        generate_kwargs(parse("Hi", "--grammar", str(tmp_path / "missing.gbnf")))
    assert "cannot read --grammar" in str(err.value)


@pytest.mark.parametrize("argv, message", [
    ((), "needs a PROMPT"),
    (("Hi", "--token-ids", "1,2"), "not both"),
    (("--token-ids", "1,x"), "comma-separated integers"),
    (("Hi", "--logit-bias", "42"), "ID=BIAS"),
    (("Hi", "--logit-bias", "x=1"), "ID=BIAS"),
])
def test_bad_generate_arguments_exit_with_a_message(argv, message):
    with pytest.raises(SystemExit) as err:
        generate_kwargs(parse(*argv))
    assert message in str(err.value)


def test_unreachable_server_is_a_grpc_error_with_nonzero_exit(capsys):
    rc = main(["generate", "--address", "127.0.0.1:1", "--timeout", "5", "Hi"])
    assert rc == 1
    assert "folio: UNAVAILABLE" in capsys.readouterr().err


def test_wait_ready_times_out(capsys):
    rc = main(["health", "--address", "127.0.0.1:1", "--wait-ready", "0.5"])
    assert rc == 1
    assert "not SERVING" in capsys.readouterr().err


@pytest.mark.parametrize("service, flag", [("serve", "--model"), ("scheduler", "--port"),
                                           ("executor", "--scheduler-address")])
def test_service_commands_reach_the_services(service, flag):
    done = folio(service, "--help", importtime=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert flag in done.stdout
    if service != "executor":  # the scheduler side never loads torch
        assert "torch" not in imported_top_level(done.stderr)


# ---- against a real server ------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def test_generate_json_on_the_default_model(default_server, hf_tokenizer):
    done = folio("generate", "--address", default_server.address, "--json", "--max-tokens",
                 "8", "--temperature", "0", "--ignore-eos", "Hello, Folio", importtime=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch" not in imported_top_level(done.stderr)
    out = json.loads(done.stdout)
    assert set(out) == {"request_id", "index", "token_ids", "text", "finish_reason",
                        "matched_stop", "usage"}
    assert out["request_id"] and out["finish_reason"] == "length"
    assert out["matched_stop"] is None
    assert len(out["token_ids"]) == 8
    assert out["text"] == hf_tokenizer.decode(out["token_ids"], skip_special_tokens=True)
    assert out["usage"] == {"prompt_tokens": len(hf_tokenizer("Hello, Folio")["input_ids"]),
                            "completion_tokens": 8, "cached_tokens": out["usage"]["cached_tokens"]}

    streamed = folio("generate", "--address", default_server.address, "--max-tokens", "8",
                     "--temperature", "0", "--ignore-eos", "Hello, Folio")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == out["text"] + "\n"  # greedy: the same completion, streamed

    # --logprobs / --prompt-logprobs: one entry per token (and per prompt token but the
    # first) in the JSON, greedy tokens ranked first.
    lp = folio("generate", "--address", default_server.address, "--json", "--max-tokens",
               "8", "--temperature", "0", "--ignore-eos", "--logprobs", "2",
               "--prompt-logprobs", "1", "Hello, Folio")
    assert lp.returncode == 0, lp.stderr
    lp = json.loads(lp.stdout)
    assert lp["token_ids"] == out["token_ids"]
    assert [e["token_id"] for e in lp["logprobs"]] == lp["token_ids"]
    assert all(e["rank"] == 1 and len(e["top_logprobs"]) == 2 for e in lp["logprobs"])
    prompt_ids = hf_tokenizer("Hello, Folio")["input_ids"]
    assert [e["token_id"] for e in lp["prompt_logprobs"]] == prompt_ids[1:]

    # A stop string from inside that completion: the text ends right before it.
    stop = out["text"][len(out["text"]) // 2:][:3]
    cut = folio("generate", "--address", default_server.address, "--json", "--max-tokens",
                "8", "--temperature", "0", "--ignore-eos", "--stop", stop, "Hello, Folio")
    assert cut.returncode == 0, cut.stderr
    cut = json.loads(cut.stdout)
    assert (cut["finish_reason"], cut["matched_stop"]) == ("stop", stop)
    assert cut["text"] == out["text"][:out["text"].index(stop)]
    assert cut["token_ids"] == out["token_ids"][:len(cut["token_ids"])]


def test_generate_chat_and_token_ids(default_server, hf_tokenizer):
    done = folio("generate", "--address", default_server.address, "--json", "--chat",
                 "--max-tokens", "3", "--ignore-eos", "Bonjour ☕")
    assert done.returncode == 0, done.stderr
    chat_ids = hf_tokenizer.apply_chat_template([{"role": "user", "content": "Bonjour ☕"}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    assert json.loads(done.stdout)["usage"]["prompt_tokens"] == len(chat_ids)

    done = folio("generate", "--address", default_server.address, "--json", "--token-ids",
                 "10,11,12,13", "--max-tokens", "2", "--ignore-eos")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["usage"]["prompt_tokens"] == 4


def test_info_stats_health(default_server):
    info = folio("info", "--address", default_server.address)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["random_weights"] is True
    stats = folio("stats", "--address", default_server.address)
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["executor_connected"] is True
    health = folio("health", "--address", default_server.address)
    assert (health.returncode, health.stdout.strip()) == (0, "SERVING")


def test_invalid_argument_prints_code_and_message(default_server):
    done = folio("generate", "--address", default_server.address, "--top-p", "1.5", "Hi")
    assert done.returncode == 1
    assert "folio: INVALID_ARGUMENT" in done.stderr and "top_p" in done.stderr


def test_generate_choice_and_a_bad_regex_through_the_command(default_server):
    done = folio("generate", "--address", default_server.address, "--json", "--choice", "red",
                 "--choice", "blue", "Pick a color:")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["text"] in ("red", "blue")
    bad = folio("generate", "--address", default_server.address, "--regex", "(", "Hi")
    assert bad.returncode == 1
    assert "folio: INVALID_ARGUMENT" in bad.stderr and "regex" in bad.stderr


def test_keygen_writes_a_private_secret_once(tmp_path, capsys):
    from protos.channel_keys import ChannelKeys, read_secret

    path = tmp_path / "channel.secret"
    assert main(["keygen", str(path)]) == 0
    secret = read_secret(str(path))
    assert secret is not None and len(secret) == 64
    assert path.stat().st_mode & 0o777 == 0o600
    ChannelKeys.from_secret(secret)  # usable as it is
    assert main(["keygen", str(path)]) == 0  # kept, not replaced
    assert read_secret(str(path)) == secret
    assert "exists; keeping it" in capsys.readouterr().err
    assert main(["keygen", str(tmp_path / "missing-dir" / "s")]) == 1


def test_racing_keygens_share_one_whole_secret(tmp_path):
    """Every service of compose.yaml runs keygen at start: racing processes must all end up
    with one secret, and a reader that sees the file never sees it half-written."""
    path = tmp_path / "channel.secret"
    code = ("import sys; from client.cli import main; from protos.channel_keys import "
            "read_secret; rc = main(['keygen', sys.argv[1]]); print(read_secret(sys.argv[1])); "
            "sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(6)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    secrets_read = {out.strip() for out, _ in outputs}
    assert secrets_read == {path.read_text().strip()} and len(secrets_read.pop()) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["channel.secret"]  # no temp left
