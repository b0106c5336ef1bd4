"""A request's input -> prompt token ids, off the event loop, after a size check.

Tokenizing a multi-megabyte text takes seconds; on the event loop it would stall every stream
and the health service. So:
1. a size check that costs nothing: a text (or a chat's roles and contents) of more characters
   than max_model_len tokens can hold is refused before any work. A token stands for at most
   `Tokenizer.max_token_chars()` characters (the longest vocabulary entry, computed once), so
   the bound is max_model_len x that;
2. chat rendering and tokenization run in a small thread pool (the `tokenizers` library
   releases the GIL while it encodes), and the template's output is bounded the same way.

max_model_len is the connected executor's (`ExecutorInfo.max_model_len`, which already counts
--max-model-len and the KV pool) or, with no executor, the model's own limit from config.json
capped by --max-model-len, so Tokenize keeps working without an executor.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from checkpoints.rope import DEFAULT_MAX_POSITION_EMBEDDINGS, context_length
from protos.folio.v1 import generator_pb2 as pb
from scheduler_svc.api import inputs
from scheduler_svc.errors import InvalidRequest
from scheduler_svc.text.tokenizer import (
    ChatOutputTooLong,
    ChatTemplateError,
    ChatTurn,
    ModelDirError,
    Tokenizer,
)

NUM_TOKENIZER_THREADS = 2  # encodes run in parallel on two cores; more would queue anyway

T = TypeVar("T")


def model_max_len(model_dir: Path, cap: int | None) -> int:
    """The model's own context limit from config.json (`checkpoints.rope.context_length`, the
    executor's rule: RoPE scaling included), capped. The executor's report replaces it once one
    connects."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        try:
            limit = context_length(config)
        except ValueError:  # a config the executor refuses at start: the context as stated
            stated = config.get("max_position_embeddings")
            limit = stated if type(stated) is int and stated > 0 else (
                DEFAULT_MAX_POSITION_EMBEDDINGS)
    except (OSError, ValueError, TypeError, AttributeError):
        # The Tokenizer read this file already; this only guards a file changed since.
        limit = DEFAULT_MAX_POSITION_EMBEDDINGS
    return min(limit, cap) if cap is not None else limit


class PromptEncoder:
    """Turns the input of a GenerateRequest or TokenizeRequest into token ids. One per server;
    `close()` stops its threads."""

    def __init__(self, tokenizer: Tokenizer, max_model_len_cap: int | None = None):
        self.tokenizer = tokenizer
        self.max_token_chars = tokenizer.max_token_chars()
        self.model_max_len = model_max_len(tokenizer.model_dir, max_model_len_cap)
        self._pool = ThreadPoolExecutor(NUM_TOKENIZER_THREADS,
                                        thread_name_prefix="folio-tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def max_chars(self, max_model_len: int) -> int:
        return max_model_len * self.max_token_chars

    async def token_ids(self, msg: pb.GenerateRequest | pb.TokenizeRequest,
                        max_model_len: int) -> list[int]:
        """The prompt as token ids, from whichever of text / token_ids / chat the client sent.
        An empty text is refused here; Tokenize answers an empty text itself."""
        match msg.WhichOneof("input"):
            case "text":
                if not msg.text:
                    raise InvalidRequest("the prompt text is empty; send some text")
                self._check_chars(len(msg.text), "the prompt text", max_model_len)
                return await self._run(self.tokenizer.encode, msg.text)
            case "token_ids":
                num_ids = len(msg.token_ids.ids)
                if num_ids > max_model_len:  # refused before copying millions of ids
                    raise InvalidRequest(inputs.prompt_too_long(num_ids, max_model_len))
                return list(msg.token_ids.ids)
            case "chat":
                return await self._chat_ids(msg.chat, max_model_len)
            case _:
                raise InvalidRequest("the request has no input; set one of text, token_ids or "
                                     "chat")

    async def bad_words(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """The token sequences `words` ban (inputs.bad_words_token_ids), off the event loop."""
        if not words:
            return ()
        return await self._run(inputs.bad_words_token_ids, words, self._encode_plain)

    def _encode_plain(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _chat_ids(self, chat: pb.Chat, max_model_len: int) -> list[int]:
        turns = inputs.chat_turns(chat, max_model_len)
        self._check_chars(sum(len(t.role) + len(t.content) for t in turns),
                          "the chat's roles and contents", max_model_len)
        add_generation_prompt = (chat.add_generation_prompt
                                 if chat.HasField("add_generation_prompt") else True)
        max_chars = self.max_chars(max_model_len)
        try:
            return await self._run(self._encode_chat, turns, add_generation_prompt, max_chars)
        except ChatOutputTooLong as e:
            raise InvalidRequest(
                f"the chat template's output for these messages passed {e.max_chars} "
                f"characters, more than max_model_len ({max_model_len}) tokens of at most "
                f"{self.max_token_chars} characters each can hold; send fewer or shorter "
                "messages") from e
        except (ChatTemplateError, ModelDirError) as e:
            raise InvalidRequest(str(e)) from e

    def _encode_chat(self, turns: list[ChatTurn], add_generation_prompt: bool,
                     max_chars: int) -> list[int]:
        return self.tokenizer.encode_chat(turns, add_generation_prompt, max_chars)

    def _check_chars(self, num_chars: int, what: str, max_model_len: int) -> None:
        if num_chars > (limit := self.max_chars(max_model_len)):
            raise InvalidRequest(
                f"{what} has {num_chars} characters, more than max_model_len "
                f"({max_model_len}) tokens can hold: the longest token of this model's "
                f"vocabulary is {self.max_token_chars} characters, so at most {limit} "
                "characters fit; shorten the input")

    async def _run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
