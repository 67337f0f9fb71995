"""bench/cpu_vs_vllm.py's pure parts: its command line, reading `vllm bench serve` results, the
medians, ratios and table, the CPU facts, and the two servers' shared settings. None needs vLLM."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_bench():
    """bench/ is not a package: load bench/cpu_vs_vllm.py by path, once."""
    name = "cpu_vs_vllm_bench"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "cpu_vs_vllm.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
    return sys.modules[name]


bench = _load_bench()


def _vllm_result(**overrides: object) -> dict[str, object]:
    """A saved `vllm bench serve` result (0.32's keys, list fields left out as without
    --save-detailed), for 96 prompts at concurrency 8."""
    result = {
        "date": "20261123-115301",
        "endpoint_type": "openai",
        "backend": "openai",
        "num_prompts": 96,
        "max_concurrency": 8,
        "duration": 2.1,
        "completed": 96,
        "failed": 0,
        "total_input_tokens": 6180,
        "total_output_tokens": 3072,
        "request_throughput": 45.7,
        "request_goodput": None,
        "output_throughput": 1462.9,
        "total_token_throughput": 4405.7,
        "mean_ttft_ms": 45.0,
        "median_ttft_ms": 39.5,
        "std_ttft_ms": 10.0,
        "p50_ttft_ms": 39.5,
        "p99_ttft_ms": 90.0,
        "mean_tpot_ms": 4.0,
        "median_tpot_ms": 3.68,
        "std_tpot_ms": 0.4,
        "p50_tpot_ms": 3.68,
        "p99_tpot_ms": 6.0,
        "mean_itl_ms": 4.0,
        "median_itl_ms": 3.1,
        "std_itl_ms": 2.0,
        "p50_itl_ms": 3.1,
        "p99_itl_ms": 19.6,
    }
    result.update(overrides)
    return result


def _metrics(tok_s: float, ttft: float, tpot: float, itl: float, input_tokens: int = 6144):
    return bench.Metrics(tok_s, ttft, tpot, itl, input_tokens)


def test_defaults_are_issue_12s_load_and_peers_sit_beside_the_repository():
    cfg = bench.parse_args([], environ={})
    assert cfg.concurrency == (8, 32)
    assert (cfg.num_prompts, cfg.input_len, cfg.output_len, cfg.rounds) == (96, 64, 32, 1)
    assert cfg.peers_dir == ROOT.parent / "shared" / "peers"
    assert cfg.vllm_venv == ROOT.parent / "peers" / "vllm-cpu"
    assert cfg.out == ROOT / "bench" / "results" / "cpu_vs_vllm.json"


def test_environment_overrides_the_default_folders_and_flags_override_both(tmp_path):
    env = {bench.PEERS_ENV: str(tmp_path / "p"), bench.VENV_ENV: str(tmp_path / "v")}
    cfg = bench.parse_args([], environ=env)
    assert (cfg.peers_dir, cfg.vllm_venv) == (tmp_path / "p", tmp_path / "v")
    cfg = bench.parse_args(["--peers", "/x", "--vllm-venv", "/y", "--concurrency", "4", "16", "64"], environ=env)
    assert (cfg.peers_dir, cfg.vllm_venv, cfg.concurrency) == (Path("/x"), Path("/y"), (4, 16, 64))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--concurrency", "0"], "concurrency"),
        (["--rounds", "0"], "rounds"),
        (["--input-len", "200", "--output-len", "100"], "max_model_len"),
        (["--port", "70000"], "port"),
    ],
)
def test_bad_arguments_are_usage_errors_that_say_which(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv, environ={})
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_reads_the_compared_metrics_from_a_saved_result():
    m = bench.read_bench_result(_vllm_result(), num_prompts=96)
    assert m == bench.Metrics(
        output_tok_s=1462.9, ttft_median_ms=39.5, tpot_median_ms=3.68, itl_p99_ms=19.6, input_tokens=6180
    )


@pytest.mark.parametrize("overrides", [{"failed": 3, "completed": 93}, {"completed": 90}])
def test_a_run_that_lost_requests_is_refused(overrides):
    with pytest.raises(RuntimeError, match="completed"):
        bench.read_bench_result(_vllm_result(**overrides), num_prompts=96)


def test_a_result_without_the_p99_percentile_names_what_is_missing():
    result = _vllm_result()
    del result["p99_itl_ms"]
    with pytest.raises(KeyError, match="p99_itl_ms"):
        bench.read_bench_result(result, num_prompts=96)


def test_medians_over_rounds_ignore_one_slow_round():
    runs = [_metrics(1000, 40, 4, 20, 6144), _metrics(200, 400, 40, 200, 6144), _metrics(1200, 30, 3, 10, 6146)]
    assert bench.median_metrics(runs) == _metrics(1000, 40, 4, 20, 6144)
    with pytest.raises(ValueError):
        bench.median_metrics([])


def test_ratios_are_moeserve_over_vllm_per_metric():
    r = bench.ratios(_metrics(900, 30, 8, 25), _metrics(1800, 40, 4, 20))
    assert r == pytest.approx({"output_tok_s": 0.5, "ttft_median_ms": 0.75, "tpot_median_ms": 2.0, "itl_p99_ms": 1.25})


def test_table_has_both_rows_and_their_ratio_per_concurrency():
    rows = {
        8: {"moeserve": _metrics(900, 30, 8, 25), "vllm": _metrics(1800, 40, 4, 20)},
        32: {"moeserve": _metrics(2000, 90, 12, 50), "vllm": _metrics(1000, 60, 24, 40)},
    }
    lines = bench.format_table(rows, {"moeserve": "moeserve X", "vllm": "vLLM Y"}).splitlines()
    assert lines[2] == "| 8 | vLLM Y | 1800 | 40.0 ms | 4.00 ms | 20.0 ms |"
    assert lines[3] == "| 8 | moeserve X | 900 | 30.0 ms | 8.00 ms | 25.0 ms |"
    assert lines[4] == "| 8 | moeserve / vLLM | 0.50x | 0.75x | 2.00x | 1.25x |"
    assert lines[7] == "| 32 | moeserve / vLLM | 2.00x | 1.50x | 0.50x | 1.25x |"
    assert len(lines) == 8


def test_cpu_facts_read_the_model_and_the_bf16_flags():
    avx2_only = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\n"
    facts = bench.cpu_facts(avx2_only)
    assert facts["model"] == "AMD EPYC"
    assert facts["flags"]["avx2"] and not facts["flags"]["avx512f"]
    assert facts["native_bf16"] is False
    zen4 = "model name\t: AMD EPYC 9004\nflags\t\t: avx2 avx512f avx512_bf16\n"
    assert bench.cpu_facts(zen4)["native_bf16"] is True
    amx_only = "model name\t: Intel Xeon\nflags\t\t: avx2 avx512f amx_tile amx_bf16\n"
    assert bench.cpu_facts(amx_only)["native_bf16"] is True
    assert bench.cpu_facts("")["model"] == ""


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_both_servers_get_the_same_model_dtype_length_and_port_and_vllm_its_own_environment(tmp_path):
    cfg = bench.parse_args(["--peers", str(tmp_path / "peers"), "--vllm-venv", str(tmp_path / "venv")], environ={})
    specs = bench.servers(cfg, tmp_path / "model", port=8123)
    for flag, value in [("--model", str(tmp_path / "model")), ("--dtype", "float32"), ("--port", "8123")]:
        assert _flag(specs["moeserve"].argv, flag) == _flag(specs["vllm"].argv, flag) == value
    assert _flag(specs["vllm"].argv, "--max-model-len") == _flag(specs["moeserve"].argv, "--max-model-len")
    assert specs["vllm"].argv[0] == str(tmp_path / "venv" / "bin" / "python")
    assert "PYTHONPATH" not in specs["vllm"].env
    assert specs["vllm"].env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert str(ROOT) in specs["moeserve"].env["PYTHONPATH"].split(os.pathsep)


def test_the_recorded_commands_name_no_path_of_this_machine(tmp_path):
    cfg = bench.parse_args(["--peers", str(tmp_path / "peers"), "--vllm-venv", str(tmp_path / "venv")], environ={})
    for server in bench.servers(cfg, tmp_path / "model", port=8123).values():
        record = bench.describe(server, tmp_path / "model")
        assert str(tmp_path) not in str(record) and sys.executable not in str(record)
        assert "--model <checkpoint>" in record["command"]
    vllm = bench.describe(bench.servers(cfg, tmp_path / "model", 8123)["vllm"], tmp_path / "model")
    assert vllm["command"].startswith("-m vllm.entrypoints.openai.api_server")
    assert vllm["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_the_load_is_the_same_for_both_servers_and_saved_where_it_is_read(tmp_path):
    cfg = bench.parse_args(["--peers", str(tmp_path / "peers"), "--vllm-venv", str(tmp_path / "venv")], environ={})
    argv = bench.bench_argv(cfg, tmp_path / "model", 8123, 32, tmp_path / "out" / "r.json")
    assert argv[1] == str(tmp_path / "peers" / "vllm_cli.py")
    assert _flag(argv, "--base-url") == "http://127.0.0.1:8123"
    assert _flag(argv, "--max-concurrency") == _flag(argv, "--num-warmups") == "32"  # one warm batch first
    assert _flag(argv, "--num-prompts") == "96"
    assert (_flag(argv, "--random-input-len"), _flag(argv, "--random-output-len")) == ("64", "32")
    assert "--ignore-eos" in argv
    assert (_flag(argv, "--result-dir"), _flag(argv, "--result-filename")) == (str(tmp_path / "out"), "r.json")
