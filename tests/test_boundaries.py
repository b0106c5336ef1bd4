"""Process boundary = package boundary: each service imports only what its process may load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import importlib, json, sys
for name in {modules!r}:
    importlib.import_module(name)
print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))
"""


def loaded_top_level(modules: list[str]) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(modules=modules)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


def service_modules(package: str) -> list[str]:
    """Every module of the package, subpackages included."""
    root = ROOT / package
    return sorted(".".join((package, *p.relative_to(root).with_suffix("").parts))
                  for p in root.rglob("*.py") if p.stem not in ("__main__", "__init__"))


@pytest.mark.parametrize("modules, forbidden", [
    (service_modules("scheduler_svc"), {"torch", "triton", "kernels", "executor_svc"}),
    (service_modules("executor_svc"), {"scheduler_svc"}),
    (["protos.plan", "protos.channel", "protos.folio.v1.generator_pb2_grpc"],
     {"torch", "triton", "kernels", "scheduler_svc", "executor_svc"}),
    (["client", "client.cli"], {"torch", "triton", "kernels", "scheduler_svc", "executor_svc"}),
], ids=["scheduler", "executor", "protos", "client"])
def test_import_boundary(modules, forbidden):
    assert modules, "no modules found to check"
    leaked = loaded_top_level(modules) & forbidden
    assert not leaked, f"importing {modules} loaded {sorted(leaked)}"


GGUF_SCHEDULER_PROBE = """
import json, sys
from scheduler_svc.text.tokenizer import Tokenizer, resolve_model_dir
tokenizer = Tokenizer(resolve_model_dir(sys.argv[1]))
assert tokenizer.encode("hello")
print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))
"""

GGUF_CONVERTER_PROBE = """
import json, runpy, sys
sys.argv = ["gguf_checkpoint", *sys.argv[1:]]
try:
    runpy.run_module("executor_svc.gguf_checkpoint", run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))
"""


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    from tests.gguf_files import make_gguf

    return make_gguf("llama2", "Q8_0", tmp_path_factory.mktemp("gguf"), num_hidden_layers=1)[1]


def _probe(code: str, args: list[str], cache_dir: Path) -> set[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FOLIO_CACHE_DIR": str(cache_dir)}
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_scheduler_serving_a_gguf_stays_torch_free(gguf_file, tmp_path):
    # The conversion happens (fresh cache) in the converter's own process.
    leaked = _probe(GGUF_SCHEDULER_PROBE, [str(gguf_file)], tmp_path) & {
        "torch", "triton", "kernels", "executor_svc", "transformers"}
    assert not leaked, f"resolving a GGUF model loaded {sorted(leaked)} into the scheduler"


def test_gguf_converter_runs_without_torch(gguf_file, tmp_path):
    # So the scheduler can run it, and the executor runs it before its torch import.
    loaded = _probe(GGUF_CONVERTER_PROBE, [str(gguf_file)], tmp_path)
    assert "transformers" in loaded  # it did convert (the tokenizer comes from transformers)
    assert not loaded & {"torch", "triton", "kernels", "scheduler_svc"}
