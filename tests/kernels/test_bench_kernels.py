"""bench.kernels: a clear refusal without CUDA, and (slow) its whole pipeline at tiny shapes."""

import json

import pytest
import torch

from bench import kernels as bench_kernels


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_refuses_without_cuda(tmp_path, capsys):
    assert bench_kernels.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_smoke_run_writes_json_and_markdown(tmp_path):
    assert bench_kernels.main(["--out", str(tmp_path), "--smoke"]) == 0
    result = json.loads((tmp_path / "kernels.json").read_text())
    assert result["environment"]["torch"] == torch.__version__
    assert len(result["decode"]) == 4 and len(result["prefill"]) == 2
    assert all(row["max_abs_err_vs_sdpa"] < 3e-2 for row in result["decode"] + result["prefill"])
    assert "| batch | context |" in (tmp_path / "kernels.md").read_text()
