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
    (service_modules("checkpoints"), {"torch", "triton", "kernels", "scheduler_svc",
                                      "executor_svc"}),
    (["protos.plan", "protos.channel", "protos.folio.v1.generator_pb2_grpc"],
     {"torch", "triton", "kernels", "scheduler_svc", "executor_svc"}),
    (["client", "client.cli"], {"torch", "triton", "kernels", "scheduler_svc", "executor_svc"}),
], ids=["scheduler", "executor", "checkpoints", "protos", "client"])
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

NAMED_MODEL_SCHEDULER_PROBE = """
import json, sys
from scheduler_svc.cli import named_model_path
from scheduler_svc.text.tokenizer import Tokenizer, resolve_model_dir
tokenizer = Tokenizer(resolve_model_dir(named_model_path(sys.argv[1])))
assert tokenizer.encode("hello")
print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))
"""

GGUF_CONVERTER_PROBE = """
import json, runpy, sys
sys.argv = ["checkpoints.gguf", *sys.argv[1:]]
try:
    runpy.run_module("checkpoints.gguf", run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))
"""


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    from tests.fixtures.gguf_files import make_gguf

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


def test_scheduler_builds_the_tiny_model_torch_free(tmp_path):
    # folio:tiny-random is built (fresh cache) in the scheduler's own process.
    leaked = _probe(NAMED_MODEL_SCHEDULER_PROBE, ["folio:tiny-random"], tmp_path) & {
        "torch", "triton", "kernels", "executor_svc", "transformers"}
    assert not leaked, f"building folio:tiny-random loaded {sorted(leaked)} into the scheduler"


def test_gguf_converter_runs_without_torch(gguf_file, tmp_path):
    # So the scheduler can run it, and the executor runs it before its torch import.
    loaded = _probe(GGUF_CONVERTER_PROBE, [str(gguf_file)], tmp_path)
    assert "transformers" in loaded  # it did convert (the tokenizer comes from transformers)
    assert not loaded & {"torch", "triton", "kernels", "scheduler_svc"}


FIRST_PARTY = ("protos", "checkpoints", "kernels", "scheduler_svc", "executor_svc", "client")
# What no module of a shared torch-free package imports, anywhere in its body.
NEVER_IMPORTED = {"checkpoints": ("torch", "triton", "kernels", "scheduler_svc", "executor_svc")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the first-party modules it imports anywhere in its body: lazy imports inside
    functions and `if TYPE_CHECKING:` imports count too (a type-only circle is still two modules
    that each need the other to be read). `from pkg import name` points at pkg.name when that is
    a module, else at pkg."""
    import ast

    modules = {_module_name(p): p for top in FIRST_PARTY if (ROOT / top).is_dir()
               for p in (ROOT / top).rglob("*.py")}

    def target(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges.update(target(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([base] if base else [])])
                for a in node.names:
                    edges.add(target(f"{base}.{a.name}") if f"{base}.{a.name}" in modules
                              else target(base))
        edges.discard(None)
        edges.discard(name)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    """No module reaches itself through imports, lazy ones included: each package's modules
    form a layered graph a reader can follow from the bottom up."""
    graph = import_graph()
    assert len(graph) > 100
    assert import_cycles(graph) == []


def imported_top_levels(path: Path) -> set[str]:
    """The top-level names of every module `path` imports anywhere in its body (lazy imports
    inside functions included); relative imports stay inside the package and are left out."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(NEVER_IMPORTED))
def test_shared_packages_never_import_torch_or_a_service(package):
    """Static, so a lazy import on a path the import probes above never take is caught too."""
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    forbidden = set(NEVER_IMPORTED[package])
    found = {str(f.relative_to(ROOT)): sorted(imported_top_levels(f) & forbidden)
             for f in files}
    assert not {f: names for f, names in found.items() if names}
