"""The model's tokenizer, chat template and stop ids, read from an HF checkpoint directory.

Only `tokenizers` (tokenizer.json) and jinja2 (tokenizer_config.json's `chat_template`) are used:
`transformers` would drag torch into the scheduler process.
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from checkpoints import resolve


class ModelDirError(ValueError):
    """A file of the model directory that the scheduler needs is missing or damaged. Raised
    while loading, the message reads ``<file>: <what is wrong>``."""


class ChatTemplateError(ValueError):
    """The chat template failed on a request's messages (whatever it raised: a template is model
    data, and what makes it fail is the client's input). The message is for the client."""


class ChatOutputTooLong(ChatTemplateError):
    """The template's output passed the caller's character bound; rendering stopped there."""

    def __init__(self, max_chars: int):
        super().__init__(f"the chat template's output for these messages passed {max_chars} "
                         "characters")
        self.max_chars = max_chars


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when there is no such file (the scheduler can do
    without each of these); a file that is there but unusable is a ModelDirError naming it."""
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ModelDirError(f"{path}: not UTF-8 text (byte {e.start}): the file is damaged or "
                            "not a JSON file") from None
    except OSError as e:  # permissions, a directory in the file's place, I/O errors
        raise ModelDirError(f"{path}: cannot be read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ModelDirError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ModelDirError(f"{path}: holds a JSON {type(value).__name__}; expected an object")
    return value


def _check_model_fields(path: Path, config: dict[str, Any]) -> None:
    """The config fields the scheduler reads have the types HF writes, or the file is refused
    (a string eos_token_id would otherwise be read character by character)."""
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list)
                                  and all(isinstance(a, str) for a in archs)):
        raise ModelDirError(f"{path}: architectures must be a list of class names, got {archs!r}")
    vocab_size = config.get("vocab_size")
    if vocab_size is not None and (not isinstance(vocab_size, int) or isinstance(vocab_size, bool)
                                   or vocab_size < 1):
        raise ModelDirError(f"{path}: vocab_size must be a positive integer, got {vocab_size!r}")
    eos = config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelDirError(f"{path}: eos_token_id must be a token id or a list of them, "
                            f"got {eos!r}")


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Templates expect plain JSON (non-ASCII kept), not jinja's HTML-escaped variant.
    return json.dumps(value, ensure_ascii=False, indent=indent)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in some
    templates; for serving it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def resolve_model_dir(model: str, cancel: threading.Event | None = None,
                      log_format: str | None = None) -> Path:
    """The local checkpoint directory behind `model`, the scheduler's way (checkpoints/
    resolve.py): a hub id fetches config and tokenizer files only; a GGUF model is converted
    (once, cached) by the converter in a subprocess, which keeps transformers out of this
    process and ends when `cancel` is set. Every failure is a ModelDirError."""
    converter = functools.partial(resolve.convert_in_subprocess, cancel=cancel,
                                  log_format=log_format)
    try:
        return resolve.resolve_model_dir(model, hub_files=resolve.HUB_CONFIG_FILES,
                                         convert_gguf=converter)
    except resolve.HubDownloadError as e:
        raise ModelDirError(f"--model {model!r} is not a directory and could not be fetched "
                            f"from the model hub ({e.cause}); pass a local checkpoint "
                            "directory") from e
    except ValueError as e:  # the converter's line, or a CheckpointError naming the file
        raise ModelDirError(str(e)) from e


class Tokenizer:
    """Encode/decode, chat rendering, and the model's EOS ids."""

    def __init__(self, model_dir: str | Path):
        """Read the model's files; any that is missing or damaged is a ModelDirError whose
        message starts with that file's path."""
        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.exists():
            raise ModelDirError(f"{tok_file}: not found (the directory has no tokenizer.json; "
                                "the scheduler needs a fast (tokenizers) tokenizer file next "
                                "to the model)")
        self.model_dir = model_dir
        try:
            self._tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception for every parse error
            raise ModelDirError(f"{tok_file}: not a valid tokenizer file ({e})") from None
        config_file = model_dir / "config.json"
        gen_config_file = model_dir / "generation_config.json"
        config = _read_json(config_file)
        gen_config = _read_json(gen_config_file)
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        _check_model_fields(config_file, config)
        _check_model_fields(gen_config_file, gen_config)

        self.model_name = model_dir.name
        self.architecture = (config.get("architectures") or [""])[0]
        self.model_type = str(config.get("model_type") or "")  # config.json's family name
        self.config_vocab_size = int(config.get("vocab_size") or self._tok.get_vocab_size())
        self.random_weights = (model_dir / "FOLIO_RANDOM_WEIGHTS").exists()
        self.special_tokens = {name: text for name in ("bos_token", "eos_token", "pad_token",
                                                       "unk_token")
                               if (text := _token_text(tok_config.get(name))) is not None}
        self.eos_token_ids = frozenset(self._eos_ids(config, gen_config))
        # Newer checkpoints keep the template in its own file; it wins over the config entry.
        jinja_file = model_dir / "chat_template.jinja"
        template_file = jinja_file if jinja_file.exists() else model_dir / "tokenizer_config.json"
        try:
            self._chat_template = self._pick_template(
                jinja_file.read_text(encoding="utf-8") if template_file == jinja_file
                else tok_config.get("chat_template"))
        except (OSError, UnicodeDecodeError) as e:
            raise ModelDirError(f"{template_file}: cannot be read ({e})") from None
        except (jinja2.TemplateError, AttributeError, TypeError) as e:
            raise ModelDirError(f"{template_file}: the chat template does not compile "
                                f"({type(e).__name__}: {e})") from None

    def _eos_ids(self, config: dict, gen_config: dict) -> set[int]:
        # generation_config.json often lists extra stop ids (e.g. end-of-turn); take the union.
        ids = _as_id_set(config.get("eos_token_id")) | _as_id_set(gen_config.get("eos_token_id"))
        if not ids and (eos := self.special_tokens.get("eos_token")) is not None:
            if (eos_id := self._tok.token_to_id(eos)) is not None:
                ids.add(eos_id)
        return ids

    @staticmethod
    def _pick_template(value: Any) -> jinja2.Template | None:
        if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in value}
            value = named.get("default") or next(iter(named.values()), None)
        if not value:
            return None
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _GenerationTag])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(value)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works and `encode` holds it, so a long text
        # tokenized on a worker thread leaves the event loop running. Same ids as `encode`.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """`spaces_between_special_tokens=False` (with special tokens kept): an added token
        right after another one is decoded on its own, so it shows as its bare content without
        the separator the decoder would put before it (vLLM's fast detokenizer does the same)."""
        if skip_special_tokens or spaces_between_special_tokens:
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        added = self.added_token_ids
        starts = [0] + [i for i in range(1, len(ids)) if ids[i] in added and ids[i - 1] in added]
        return "".join(self._tok.decode(ids[a:b], skip_special_tokens=False)
                       for a, b in zip(starts, [*starts[1:], len(ids)], strict=True))

    @functools.cached_property
    def added_token_ids(self) -> frozenset[int]:
        """Ids of the tokenizer's added tokens (special or not)."""
        return frozenset(self._tok.get_added_tokens_decoder())

    def max_token_chars(self) -> int:
        """The most input characters one token stands for: the longest vocabulary entry, added
        tokens included (byte-level vocabularies spell each byte as one character, and a
        character is at least one byte). So a text longer than max_model_len x this cannot fit
        in max_model_len tokens. Only a normalizer that deletes characters, or composes several
        into one (NFC on stacked combining marks), makes some text denser than that; no text
        is made of such characters alone."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def render_chat(self, turns: list[ChatTurn], add_generation_prompt: bool = True,
                    max_chars: int | None = None) -> str:
        """The chat rendered by the model's template. Raises ChatTemplateError for anything the
        template raises, and ChatOutputTooLong as soon as the output passes `max_chars`: the
        output is generated piece by piece, so a template that repeats its input never builds
        a huge string."""
        if self._chat_template is None:
            raise ModelDirError(f"the model in {self.model_dir} has no chat template "
                                "(tokenizer_config.json 'chat_template'); send text instead")
        messages = [{"role": t.role, "content": t.content} for t in turns]
        pieces: list[str] = []
        num_chars = 0
        try:
            for piece in self._chat_template.generate(
                    messages=messages, add_generation_prompt=add_generation_prompt,
                    **self.special_tokens):
                num_chars += len(piece)
                if max_chars is not None and num_chars > max_chars:
                    raise ChatOutputTooLong(max_chars)
                pieces.append(piece)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:  # raise_exception(), undefined names, sandbox limits
            raise ChatTemplateError(f"the model's chat template rejected these messages: {e}"
                                    ) from e
        except Exception as e:  # e.g. the sandbox's OverflowError, a TypeError in the template
            raise ChatTemplateError(f"the model's chat template failed on these messages "
                                    f"({type(e).__name__}: {e})") from e
        return "".join(pieces)

    def encode_chat(self, turns: list[ChatTurn], add_generation_prompt: bool = True,
                    max_chars: int | None = None) -> list[int]:
        # Templates write BOS and the turn markers themselves, so no special tokens are added.
        return self.encode(self.render_chat(turns, add_generation_prompt, max_chars),
                           add_special_tokens=False)
