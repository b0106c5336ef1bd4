"""Process boundary = package boundary: each service imports only what its process may load."""

from __future__ import annotations

import json
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
    return sorted(f"{package}.{p.stem}" for p in (ROOT / package).glob("*.py")
                  if p.stem != "__main__")


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
