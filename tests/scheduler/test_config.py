"""Scheduler configuration: flags parse into the frozen dataclass; bad values get a sentence."""

from __future__ import annotations

import pytest

from scheduler_svc.config import SchedulerConfig, config_from_argv


def test_defaults_match_the_brief():
    config = config_from_argv(["--model", "/m"])
    assert (config.host, config.port, config.max_num_seqs, config.max_num_batched_tokens,
            config.max_model_len, config.log_format) == ("127.0.0.1", 50051, 256, 2048, None,
                                                          "console")
    assert config.executor_address is None  # cli picks tcp://127.0.0.1:5557 (serve: any port)
    assert config.executor_flags() == ["--max-num-seqs", "256", "--max-num-batched-tokens", "2048"]
    assert (config.enable_prefix_caching, config.preemption_mode) == (True, "auto")


def test_memory_flags():
    config = config_from_argv(["--no-prefix-caching", "--preemption-mode", "swap",
                               "--swap-space", "0.5"])
    assert (config.enable_prefix_caching, config.preemption_mode) == (False, "swap")
    assert config.executor_flags() == ["--swap-space", "0.5", "--max-num-seqs", "256",
                                       "--max-num-batched-tokens", "2048"]
    tiered = config_from_argv(["--kv-offloading-size", "2", "--kv-offloading-path", "/dev/shm/t"])
    assert tiered.executor_flags()[:4] == ["--kv-offloading-size", "2.0",
                                           "--kv-offloading-path", "/dev/shm/t"]
    assert config_from_argv(["--prefix-caching"]).enable_prefix_caching


def test_executor_flags_pass_through():
    config = config_from_argv(["--block-size", "32", "--num-kv-blocks", "100", "--dtype",
                               "float16", "--device", "cpu", "--kv-cache-memory", "2GiB",
                               "--max-model-len", "512", "--max-num-seqs", "40",
                               "--max-num-batched-tokens", "1024", "--enforce-eager",
                               "--gpu-memory-utilization", "0.8"])
    assert config.executor_flags() == ["--block-size", "32", "--num-kv-blocks", "100",
                                       "--kv-cache-memory", "2GiB", "--dtype", "float16",
                                       "--device", "cpu", "--max-model-len", "512",
                                       "--gpu-memory-utilization", "0.8",
                                       "--max-num-seqs", "40", "--max-num-batched-tokens",
                                       "1024", "--enforce-eager"]
    # Every flag it passes, the executor's own parser reads into its config.
    from executor_svc.cli import build_parser, config_from_args

    executor = config_from_args(build_parser().parse_args(["--model", "/m",
                                                           *config.executor_flags()]))
    assert (executor.max_num_seqs, executor.max_num_batched_tokens, executor.enforce_eager,
            executor.block_size, executor.gpu_memory_utilization) == (40, 1024, True, 32, 0.8)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_seqs=0), "--max-num-seqs must be at least 1"),
    (dict(max_num_batched_tokens=0), "--max-num-batched-tokens must be at least 1"),
    (dict(port=70000), "--port must be between 0 and 65535"),
    (dict(max_model_len=1), "--max-model-len must leave room"),
    (dict(log_format="xml"), "--log-format must be 'console' or 'json'"),
    (dict(dtype="int8"), "--dtype must be one of"),
    (dict(executor_timeout_s=0), "--executor-timeout must be a positive"),
    (dict(stall_timeout_s=-1.0), "--stall-timeout must be a number of seconds >= 0"),
    (dict(stall_timeout_s=float("nan")), "--stall-timeout must be a number of seconds >= 0"),
    (dict(preemption_mode="evict"), "--preemption-mode must be one of"),
    (dict(swap_space=-1.0), "--swap-space must be >= 0"),
    (dict(kv_offloading_size=-1.0), "--kv-offloading-size must be >= 0"),
    (dict(kv_offloading_size=float("inf")), "--kv-offloading-size must be >= 0"),
    (dict(kv_offloading_size=2.0, enable_prefix_caching=False), "it needs prefix caching"),
    (dict(gpu_memory_utilization=0.0), "--gpu-memory-utilization must be in"),
    (dict(gpu_memory_utilization=float("nan")), "--gpu-memory-utilization must be in"),
    (dict(gpu_memory_utilization=1.5), "--gpu-memory-utilization must be in"),
])
def test_bad_values_are_explained(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        SchedulerConfig(**kwargs)


def test_the_stall_timeout_flag():
    assert SchedulerConfig().stall_timeout_s == 300.0
    assert config_from_argv(["--stall-timeout", "0"]).stall_timeout_s == 0.0  # off
    assert config_from_argv(["--stall-timeout", "42.5"]).stall_timeout_s == 42.5


def test_bad_flag_exits_with_usage(capsys):
    with pytest.raises(SystemExit):
        config_from_argv(["--max-num-seqs", "0"])
    assert "--max-num-seqs must be at least 1" in capsys.readouterr().err


def test_kv_cache_dtype_passes_through_to_the_executor():
    config = config_from_argv(["--kv-cache-dtype", "fp8"])
    assert "--kv-cache-dtype" in config.executor_flags()
    from executor_svc.cli import build_parser, config_from_args

    executor = config_from_args(build_parser().parse_args(["--model", "/m",
                                                           *config.executor_flags()]))
    assert executor.kv_cache_dtype == "fp8"
    assert config_from_argv([]).kv_cache_dtype is None  # the executor's default, auto
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, fp8, "
                                         "fp8_e4m3, int8, got 'e5m2'"):
        SchedulerConfig(kv_cache_dtype="e5m2")
