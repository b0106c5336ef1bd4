"""Admission at the context's edge through `folio serve` and the real executor: a prompt of
exactly max_model_len tokens gets its one token (LENGTH) with n = 1, n > 1 and beam search,
at the model's limit and where the KV pool caps max_model_len; one token more is refused with
INVALID_ARGUMENT. (A prompt of max_model_len tokens with n = 1 used to get no answer at all.)"""

from __future__ import annotations

import grpc
import pytest

from client import FolioClient
from tests.conftest import TINY_RANDOM
from tests.e2e.e2e_util import wait_idle

pytestmark = pytest.mark.timeout(300)

SEQUENCES = [dict(n=1), dict(n=3, temperature=1.0, seed=7), dict(n=2, beam_width=2)]


def prompt_of(num_tokens: int) -> list[int]:
    return [100 + (i * 37) % 900 for i in range(num_tokens)]


def check_edge(address: str, expected_max_model_len: int) -> None:
    with FolioClient(address, timeout=120.0) as client:
        max_model_len = client.model_info()["max_model_len"]
        assert max_model_len == expected_max_model_len
        for sequences in SEQUENCES:
            for num_prompt in (max_model_len - 1, max_model_len):
                choices = client.generate_choices(token_ids=prompt_of(num_prompt), **sequences)
                assert [c.index for c in choices] == list(range(sequences["n"]))
                for c in choices:
                    assert len(c.token_ids) == 1, (sequences, num_prompt, c)
                    assert c.finish_reason == "length"
                    assert c.usage["prompt_tokens"] == num_prompt
                    assert c.usage["completion_tokens"] == 1
            with pytest.raises(grpc.RpcError) as err:
                client.generate_choices(token_ids=prompt_of(max_model_len + 1), **sequences)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (f"prompt has {max_model_len + 1} tokens but max_model_len is "
                    f"{max_model_len}") in err.value.details()
    stats = wait_idle(address)
    assert stats["num_stalled_requests"] == 0


def test_a_prompt_of_max_model_len_tokens_gets_one_token(default_server):
    check_edge(default_server.address, 2048)


def test_the_same_where_the_kv_pool_caps_max_model_len(folio_server):
    with folio_server(model=TINY_RANDOM, args=["--num-kv-blocks", "8", "--block-size", "16"]
                      ) as server:
        check_edge(server.address, 128)
