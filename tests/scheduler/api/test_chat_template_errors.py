"""Whatever a chat template raises while rendering a request's messages is INVALID_ARGUMENT with
the template's message, and its output is bounded: the server never answers INTERNAL for it."""

from __future__ import annotations

import grpc
import pytest

from protos.folio.v1 import generator_pb2 as pb
from scheduler_svc.text.tokenizer import ChatOutputTooLong, ChatTemplateError, ChatTurn, Tokenizer
from tests.fixtures.tiny_model import write_model_dir
from tests.scheduler.grpc_harness import collect, gen_request, null_continuation, running_server

pytestmark = pytest.mark.timeout(60)

# template -> what the client's message must say
FAILING_TEMPLATES = {
    "raise_exception": ("{{ raise_exception('only user and assistant roles are supported') }}",
                        "rejected these messages: only user and assistant roles are supported"),
    "sandbox range": ("{% for i in range(10**12) %}{% endfor %}",
                      "failed on these messages (OverflowError: Range too big"),
    "sandbox attribute": ("{{ messages.__class__.__name__ }}", "rejected these messages: access to "
                          "attribute '__class__' of 'list' object is unsafe"),
    "sandbox mutation": ("{% set _ = messages.append(1) %}", "rejected these messages: "
                         "access to attribute 'append' of 'list' object is unsafe"),
    "type error": ("{{ messages[0]['content'] + 1 }}", "failed on these messages (TypeError: "),
    "division by zero": ("{{ 1 / (messages | length - messages | length) }}",
                         "failed on these messages (ZeroDivisionError: "),
    "recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
                  "failed on these messages (RecursionError: "),
}
# Writes every message 100k times: far past any bound, if it were rendered to the end.
REPEATING_TEMPLATE = ("{% for i in range(100000) %}{% for m in messages %}{{ m['content'] }}"
                      "{% endfor %}{% endfor %}")


def tokenizer_with_template(tmp_path, template: str) -> Tokenizer:
    model_dir = write_model_dir(tmp_path)
    (model_dir / "chat_template.jinja").write_text(template)
    return Tokenizer(model_dir)


@pytest.mark.parametrize("template, message", FAILING_TEMPLATES.values(),
                         ids=FAILING_TEMPLATES.keys())
def test_any_template_exception_becomes_a_chat_template_error(tmp_path, template, message):
    tok = tokenizer_with_template(tmp_path, template)
    with pytest.raises(ChatTemplateError) as err:
        tok.render_chat([ChatTurn("user", "hi")])
    assert message in str(err.value)


def test_template_output_stops_at_the_bound(tmp_path):
    tok = tokenizer_with_template(tmp_path, REPEATING_TEMPLATE)
    with pytest.raises(ChatOutputTooLong) as err:
        tok.render_chat([ChatTurn("user", "0123456789")], max_chars=1000)
    assert err.value.max_chars == 1000
    assert len(tok.render_chat([ChatTurn("user", "ab")], max_chars=200_000)) == 200_000


CHAT = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])


async def tokenize_chat(stub):
    return await stub.Tokenize(pb.TokenizeRequest(chat=CHAT))


async def generate_chat(stub):
    return await collect(stub.Generate(pb.GenerateRequest(chat=CHAT)))


async def test_template_failures_are_invalid_argument_and_serving_continues(tmp_path):
    for i, (template, message) in enumerate(FAILING_TEMPLATES.values()):
        tok = tokenizer_with_template(tmp_path / str(i), template)
        async with running_server(tok) as h:
            await h.serve()
            for call in (tokenize_chat, generate_chat):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(h.stub)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, template
                assert message in err.value.details()
            responses = await collect(h.stub.Generate(gen_request(max_tokens=2)))
            assert [t for r in responses for t in r.token_ids] == \
                null_continuation([5, 6, 7], 2)


async def test_a_huge_template_output_is_refused_with_the_bound(tmp_path):
    tok = tokenizer_with_template(tmp_path, REPEATING_TEMPLATE)
    async with running_server(tok) as h:
        await h.serve()  # max_model_len 64, longest token 12 characters: 768 characters
        chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hello")])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(h.stub.Generate(pb.GenerateRequest(chat=chat)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("the chat template's output for these messages passed 768 characters, more "
                "than max_model_len (64) tokens of at most 12 characters each can hold"
                in err.value.details())
