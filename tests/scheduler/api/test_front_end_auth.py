"""API key, TLS and the served model name on the real SchedulerServer (null-model executor);
the same through `folio serve` and the clients is in tests/e2e/api/test_e2e_front_end.py."""

from __future__ import annotations

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.folio.v1 import generator_pb2 as pb
from scheduler_svc.api.auth import MISSING_KEY, WRONG_KEY
from scheduler_svc.config import SchedulerConfig, config_from_argv
from tests.fixtures.tls_certs import self_signed_cert
from tests.scheduler.front_end import with_invalid_utf8
from tests.scheduler.grpc_harness import (
    SERVING,
    collect,
    gen_request,
    null_continuation,
    running_server,
)
from tests.scheduler.null_executor import make_hello

pytestmark = pytest.mark.timeout(60)

KEY = "s3cret-key_0123456789"


def bearer(key: str, scheme: str = "Bearer") -> tuple[tuple[str, str], ...]:
    return (("authorization", f"{scheme} {key}"),)


async def unauthenticated(call) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    return err.value.details()


async def reflection_services(target: str, metadata=None) -> set[str]:
    async with grpc.aio.insecure_channel(target) as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            metadata=metadata)
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        response = await call.read()
        await call.done_writing()
    return {s.name for s in response.list_services_response.service}


async def test_api_key_guards_every_call_but_health(tiny_tokenizer):
    async with running_server(tiny_tokenizer, api_key=KEY) as h:
        await h.serve()
        assert await h.health_status() == SERVING  # no key needed
        assert await unauthenticated(collect(h.stub.Generate(gen_request()))) == MISSING_KEY
        assert await unauthenticated(
            collect(h.stub.Generate(gen_request(), metadata=bearer("wrong")))) == WRONG_KEY
        assert await unauthenticated(
            collect(h.stub.Generate(gen_request(), metadata=bearer(KEY + "x")))) == WRONG_KEY
        assert await unauthenticated(collect(h.stub.Generate(
            gen_request(), metadata=(("authorization", KEY),)))) == MISSING_KEY  # no scheme
        for call in (h.stub.Tokenize(pb.TokenizeRequest(text="hi")),
                     h.stub.Abort(pb.AbortRequest(request_id="x")),
                     h.stub.GetModelInfo(pb.GetModelInfoRequest()),
                     h.stub.GetServerStats(pb.GetServerStatsRequest())):
            assert await unauthenticated(call) == MISSING_KEY
        # A refused call's payload is not even parsed: bad bytes get UNAUTHENTICATED too.
        bad = with_invalid_utf8(pb.GenerateRequest(text="TEXT"), "TEXT")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.server.port}") as channel:
            call = channel.unary_stream("/folio.v1.Generator/Generate")
            assert await unauthenticated(collect(call(bad))) == MISSING_KEY
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await reflection_services(f"127.0.0.1:{h.server.port}")
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # With the key (any case of "Bearer"), everything works.
        for scheme in ("Bearer", "bearer"):
            responses = await collect(h.stub.Generate(gen_request(max_tokens=3),
                                                      metadata=bearer(KEY, scheme)))
            assert [t for r in responses for t in r.token_ids] == \
                null_continuation([5, 6, 7], 3)
        assert "folio.v1.Generator" in await reflection_services(
            f"127.0.0.1:{h.server.port}", bearer(KEY))


async def test_tls_with_an_api_key(tiny_tokenizer, tmp_path):
    cert, key = self_signed_cert(tmp_path)
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    async with running_server(tiny_tokenizer, credentials, api_key=KEY, tls_cert=str(cert),
                              tls_key=str(key)) as h:
        await h.serve()
        assert await h.health_status() == SERVING
        responses = await collect(h.stub.Generate(gen_request(max_tokens=2),
                                                  metadata=bearer(KEY)))
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert await unauthenticated(collect(h.stub.Generate(gen_request()))) == MISSING_KEY
        # The port speaks only TLS: a plaintext client cannot even connect.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.server.port}") as plain:
            stub = type(h.stub)(plain)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer(KEY),
                                        timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_model_info_reports_the_served_name_never_a_path(tiny_tokenizer):
    secret_path = "/srv/models/internal/llama-70b"
    for config, expected in ((dict(), tiny_tokenizer.model_dir.name),
                             (dict(served_model_name="tiny-chat"), "tiny-chat")):
        async with running_server(tiny_tokenizer, **config) as h:
            info = await h.stub.GetModelInfo(pb.GetModelInfoRequest())  # no executor yet
            assert info.model_name == expected
            await h.serve(hello=make_hello(model_name=secret_path))
            info = await h.stub.GetModelInfo(pb.GetModelInfoRequest())
            assert info.model_name == expected and info.num_kv_blocks == 32


def test_front_end_flags(tmp_path, monkeypatch):
    monkeypatch.delenv("FOLIO_API_KEY", raising=False)
    cert, key = self_signed_cert(tmp_path)
    key_file = tmp_path / "api-key"
    key_file.write_text(f"{KEY}\n")
    config = config_from_argv(["--served-model-name", "m", "--api-key-file", str(key_file),
                               "--tls-cert", str(cert), "--tls-key", str(key)])
    assert (config.served_model_name, config.api_key, config.tls_cert, config.tls_key) == \
        ("m", KEY, str(cert), str(key))
    assert KEY not in repr(config)  # never printed with the config
    assert config_from_argv([]).api_key is None
    monkeypatch.setenv("FOLIO_API_KEY", "from-env")
    assert config_from_argv([]).api_key == "from-env"
    assert config_from_argv(["--api-key", "flag"]).api_key == "flag"


@pytest.mark.parametrize("argv, message", [
    (["--api-key", "a", "--api-key-file", __file__], "not allowed with argument"),
    (["--api-key-file", "/nonexistent/key"], "cannot read the API key file"),
    (["--api-key", " padded"], "must be non-empty printable ASCII"),
    (["--api-key", "tab\tkey"], "must be non-empty printable ASCII"),
    (["--api-key", "clé"], "must be non-empty printable ASCII"),
    (["--tls-cert", "c.pem"], "TLS needs both --tls-cert and --tls-key"),
    (["--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"],
     "--tls-cert '/nonexistent/c.pem' is not a readable PEM file"),
    (["--served-model-name", ""], "--served-model-name must be 1 to 256 printable"),
])
def test_bad_front_end_flags_are_explained(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("FOLIO_API_KEY", raising=False)
    with pytest.raises(SystemExit):
        config_from_argv(argv)
    assert message in capsys.readouterr().err


def test_a_non_pem_key_file_is_refused(tmp_path):
    cert, _ = self_signed_cert(tmp_path)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a key")
    with pytest.raises(ValueError, match="--tls-key .* is not a readable PEM file"):
        SchedulerConfig(tls_cert=str(cert), tls_key=str(junk))
