"""The Go example (client/go) builds offline with Debian's Go toolchain and streams a completion
from a real `folio serve`. Skipped where go, protoc or the Go plugins/libraries are missing
(scripts/build-go-client.sh names the Debian packages)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from client import FolioClient
from tests.conftest import TINY_RANDOM

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ["go", "protoc", "protoc-gen-go", "protoc-gen-go-grpc"]
GRPC_GO = Path("/usr/share/gocode/src/google.golang.org/grpc")
PROMPT = "Once upon a time"
MAX_TOKENS = 12

missing = [t for t in TOOLS if shutil.which(t) is None] + (
    [] if GRPC_GO.is_dir() else [str(GRPC_GO)])
pytestmark = pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


@pytest.fixture(scope="module")
def go_client(tmp_path_factory) -> Path:
    binary = tmp_path_factory.mktemp("go") / "folio-generate"
    built = subprocess.run([str(ROOT / "scripts" / "build-go-client.sh"), str(binary)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-4000:]
    return binary


@pytest.fixture(scope="module")
def tiny_server(folio_server):
    with folio_server(model=TINY_RANDOM) as server:
        yield server


def _run(binary: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120)


def test_go_client_streams_what_the_python_client_gets(go_client, tiny_server):
    run = _run(go_client, "-address", tiny_server.address, "-wait", "30s",
               "-max-tokens", str(MAX_TOKENS), "-temperature", "0", "-ignore-eos", PROMPT)
    assert run.returncode == 0, run.stderr
    with FolioClient(tiny_server.address) as client:
        oracle = client.generate_text(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                      ignore_eos=True)
    # Greedy: the same text through either client; the finish line reports the usage.
    assert run.stdout == oracle.text + "\n"
    prompt_tokens = oracle.usage["prompt_tokens"]
    assert (f"FINISH_REASON_LENGTH: {prompt_tokens} prompt + {MAX_TOKENS} completion tokens"
            in run.stderr)


def test_go_client_reports_a_refused_request(go_client, tiny_server):
    run = _run(go_client, "-address", tiny_server.address, "")  # an empty prompt
    assert run.returncode == 1
    assert "folio: InvalidArgument: " in run.stderr and "empty" in run.stderr


@pytest.mark.skipif(shutil.which("buf") is None, reason="needs buf (e.g. npm's @bufbuild/buf)")
def test_buf_recipe_generates_what_the_script_does(tmp_path):
    by_buf, by_script = tmp_path / "buf", tmp_path / "script"
    ran = subprocess.run(["buf", "generate", "-o", str(by_buf)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    ran = subprocess.run([str(ROOT / "scripts" / "gen-go.sh"), str(by_script)],
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    stubs = sorted(p.relative_to(by_script) for p in by_script.rglob("*.go"))
    assert [str(p) for p in stubs] == ["gen/folio/v1/generator.pb.go",
                                       "gen/folio/v1/generator_grpc.pb.go"]

    def code(path: Path) -> list[str]:  # buf names no protoc version in the header
        return [line for line in path.read_text().splitlines() if "// \tprotoc " not in line]

    for stub in stubs:
        # -o prefixes buf.gen.yaml's `out: client/go`
        assert code(by_buf / "client" / "go" / stub) == code(by_script / stub), stub
