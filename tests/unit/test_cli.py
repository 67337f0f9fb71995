"""The `moeserve` command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from moeserve.cli import build_parser, main
from moeserve.engine_config import EngineConfig
from moeserve.options import build, options
from moeserve.server_config import ServerSettings


def run_cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moeserve.cli", *args], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "mixtral"
    result = run_cli(
        "make-model",
        "--arch",
        "mixtral",
        "--out",
        str(out),
        "--layers",
        "2",
        "--hidden",
        "64",
        "--experts",
        "6",
        "--top-k",
        "2",
        "--vocab",
        "300",
        "--seed",
        "3",
    )
    assert result.returncode == 0, result.stderr
    return out


def test_make_model_writes_a_checkpoint_transformers_loads(made):
    model = AutoModelForCausalLM.from_pretrained(made)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_local_experts, config.num_experts_per_tok) == (
        2,
        64,
        6,
        2,
    )
    assert config.vocab_size == 300
    assert AutoTokenizer.from_pretrained(made).chat_template
    assert (made / "generation_config.json").exists()


def test_make_model_writes_a_hybrid_the_server_generates_from(tmp_path):
    """The hybrid arch through the CLI end to end: make-model, then generate over what it wrote."""
    out = tmp_path / "qwen3_5_moe"
    result = run_cli("make-model", "--arch", "qwen3_5_moe", "--out", str(out), "--layers", "2")
    assert result.returncode == 0, result.stderr
    assert AutoConfig.from_pretrained(out).layer_types == ["linear_attention", "full_attention"]
    result = run_cli("generate", "--model", str(out), "--prompt-ids", "5,6,7", "--max-tokens", "4", "--ignore-eos")
    assert result.returncode == 0, result.stderr


def test_generate_json(made):
    result = run_cli(
        "generate", "--model", str(made), "--prompt-ids", "5,6,7", "--max-tokens", "6", "--ignore-eos", "--json"
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert set(payload) == {"text", "token_ids", "finish_reason"}
    assert len(payload["token_ids"]) == 6 and payload["finish_reason"] == "length"
    # The text is the tokens' decoding; a trailing partial UTF-8 character (U+FFFD) is left out.
    decoded = AutoTokenizer.from_pretrained(made).decode(payload["token_ids"])
    assert payload["text"] and decoded.rstrip("\ufffd") == payload["text"].rstrip("\ufffd")
    again = json.loads(
        run_cli(
            "generate", "--model", str(made), "--prompt-ids", "5,6,7", "--max-tokens", "6", "--ignore-eos", "--json"
        ).stdout
    )
    assert again == payload  # greedy is deterministic


def test_generate_on_the_demo_model(tmp_path):
    import os

    env = {**os.environ, "MOESERVE_CACHE_DIR": str(tmp_path)}
    result = run_cli("generate", "--prompt", "Hello", "--max-tokens", "4", "--ignore-eos", "--json", env=env)
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert len(payload["token_ids"]) == 4 and payload["finish_reason"] == "length"
    assert not any(tmp_path.iterdir())  # the trained demo ships with the package: nothing is built


def test_bad_input_is_one_clear_line(made):
    result = run_cli("generate", "--model", str(made), "--prompt-ids", "5,99999", "--json")
    assert result.returncode == 2 and result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "prompt token id 99999 is out of the vocabulary [0, 300)" in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_launch_flags_are_the_config_fields_with_their_defaults(monkeypatch) -> None:
    for name in ("NNODES", "SLURM_NNODES", "NODE_RANK", "GROUP_RANK", "SLURM_NODEID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    args = parse("launch")
    for opt in options(EngineConfig):
        expected = opt.meta.launch_default if opt.meta.launch_default is not None else opt.default
        assert getattr(args, opt.name) == expected, opt.name
        assert opt.help or opt.meta.hidden, f"{opt.name} has no field doc to serve as its help"
    assert args.max_waiting == 1024  # a server sheds load; offline LLM.generate queues all its prompts
    assert EngineConfig.from_options(**{n: getattr(args, n) for n in args.engine_options}).max_waiting == 1024


def test_server_flags_are_the_settings_fields_and_help_never_shows_the_key(monkeypatch, capsys) -> None:
    monkeypatch.setenv("MOESERVE_API_KEY", "not-for-your-eyes")
    args = parse("launch", "--max-request-body", "1MiB", "--port", "0")
    settings = build(ServerSettings, {n: getattr(args, n) for n in args.server_options})
    assert settings == ServerSettings(api_key="not-for-your-eyes", max_body_bytes=1024**2, port=0)
    for opt in options(ServerSettings):
        assert opt.help, f"{opt.name} has no field doc to serve as its help"
    with pytest.raises(SystemExit):
        parse("launch", "--help")
    help_text = capsys.readouterr().out
    assert "$MOESERVE_API_KEY" in help_text and "not-for-your-eyes" not in help_text


def test_every_flag_name_users_type_keeps_working() -> None:
    args = parse(
        "launch",
        "--kv-cache-memory",
        "4GiB",
        "--slo-ttft-ms",
        "250",
        "--slo-tbt-ms",
        "20",
        "--debug-min-step-time-ms",
        "30",
        "--collective-timeout",
        "9",
        "--heartbeat-timeout",
        "2",
        "--distributed-backend",
        "gloo",
        "--block-size",
        "8",
    )
    config = EngineConfig.from_options(**{n: getattr(args, n) for n in args.engine_options})
    assert config.cache.memory_bytes == 4 * 1024**3 and config.cache.block_size == 8
    assert (config.slo.ttft_s, config.slo.tbt_s, config.min_step_time_s) == pytest.approx((0.25, 0.02, 0.03))
    assert (config.parallel.collective_timeout_s, config.parallel.heartbeat_timeout_s, config.parallel.backend) == (
        9.0,
        2.0,
        "gloo",
    )


def test_launcher_variables_are_the_layout_defaults(monkeypatch) -> None:
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    args = parse("launch", "--ep", "4")
    config = EngineConfig.from_options(**{n: getattr(args, n) for n in args.engine_options})
    assert (config.parallel.nnodes, config.parallel.node_rank, config.parallel.master_addr) == (2, 1, "10.0.0.1")
    assert config.parallel.master_port == 29500  # unset across nodes: the port every node can agree on


def test_a_bad_size_is_a_usage_error_that_says_why(capsys) -> None:
    with pytest.raises(SystemExit):
        parse("launch", "--kv-cache-memory", "lots")
    assert "not a size: 'lots'" in capsys.readouterr().err


def test_llm_takes_the_flag_names_and_refuses_others(made) -> None:
    from moeserve import LLM

    with pytest.raises(TypeError, match=r"unknown option\(s\) max_num_seq; valid options: .*\bmax_num_seqs\b"):
        LLM(str(made), max_num_seq=4)
    assert EngineConfig.from_options(slo_ttft_ms=100.0, kv_cache_blocks=7).slo.ttft_s == pytest.approx(0.1)


def test_the_token_budget_derives_from_max_num_seqs_unless_given() -> None:
    assert EngineConfig.from_options().max_num_batched_tokens == 8192
    assert EngineConfig.from_options(max_num_seqs=10_000).max_num_batched_tokens == 10_000
    explicit = EngineConfig.from_options(max_num_seqs=300, max_num_batched_tokens=100)
    assert explicit.max_num_batched_tokens == 100  # no silent clamp: SchedulerConfig refuses it by name


def test_explicit_budget_below_max_num_seqs_is_one_clear_error(made, caplog) -> None:
    """In this process (the exit status and the single log line of a refusal are checked through
    a real command by test_bad_input_is_one_clear_line)."""
    argv = ["generate", "--model", str(made), "--prompt-ids", "5", "--max-num-seqs", "300"]
    assert main([*argv, "--max-num-batched-tokens", "100"]) == 2
    (error,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "max_num_batched_tokens (100) must be >= max_num_seqs (300)" in error.getMessage()


def test_device_auto_is_the_gpu_when_there_is_one() -> None:
    import torch

    assert EngineConfig.from_options().device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert EngineConfig.from_options(device="cpu").device == "cpu"


def test_two_batch_overlap_is_a_switch() -> None:
    def overlap(*argv: str) -> bool:
        args = parse(*argv)
        return EngineConfig.from_options(
            **{n: getattr(args, n) for n in args.engine_options}
        ).parallel.two_batch_overlap

    assert overlap("launch") is False
    assert overlap("launch", "--ep", "4", "--two-batch-overlap") is True
    assert overlap("generate", "--prompt", "hi", "--two-batch-overlap") is True
    assert overlap("launch", "--two-batch-overlap", "--no-two-batch-overlap") is False
    assert EngineConfig.from_options(two_batch_overlap=True).parallel.two_batch_overlap is True


def test_dispatch_fp8_is_a_switch() -> None:
    def fp8(*argv: str) -> bool:
        args = parse(*argv)
        return EngineConfig.from_options(**{n: getattr(args, n) for n in args.engine_options}).parallel.dispatch_fp8

    assert fp8("launch") is False
    assert fp8("launch", "--ep", "4", "--dispatch-fp8") is True
    assert fp8("generate", "--prompt", "hi", "--dispatch-fp8") is True
    assert EngineConfig.from_options(dispatch_fp8=True).parallel.dispatch_fp8 is True


def test_indexer_key_dtype_is_a_choice() -> None:
    def key_dtype(*argv: str) -> str:
        args = parse(*argv)
        return EngineConfig.from_options(**{n: getattr(args, n) for n in args.engine_options}).indexer_key_dtype

    assert key_dtype("launch") == "auto"
    assert key_dtype("launch", "--indexer-key-dtype", "fp8") == "fp8"
    with pytest.raises(ValueError, match="indexer key dtype 'int8'"):
        EngineConfig(indexer_key_dtype="int8")  # type: ignore[arg-type]


def test_num_comm_sms_reaches_the_nvshmem_dispatcher() -> None:
    from moeserve.dispatch import DispatchRows, ExpertPlacement, ep_dispatcher

    def parallel(*argv: str):
        args = parse(*argv)
        return EngineConfig.from_options(**{n: getattr(args, n) for n in args.engine_options}).parallel

    assert parallel("launch").num_comm_sms is None
    config = parallel("launch", "--a2a-backend", "nvshmem", "--num-comm-sms", "7")
    assert config.num_comm_sms == 7
    # ep 1 on CPU: one rank, no process group, the emulated heap (what a rank builds at ep 1)
    rows = DispatchRows(hidden_size=8, top_k=2, dtype=torch.float32)
    dispatcher = ep_dispatcher(config, ExpertPlacement.contiguous(4), "cpu", None, rows)
    assert dispatcher.name == "nvshmem" and dispatcher.num_programs == 7
    for bad in ("0", "-3"):
        with pytest.raises(ValueError, match="num_comm_sms must be at least 1"):
            parallel("launch", "--num-comm-sms", bad)


def test_nvlink_domain_size_reaches_the_nvshmem_dispatcher() -> None:
    """Default: one node's ranks (every peer by stores on one node, puts between nodes); the flag
    narrows it, and must divide the group, or be 0 (every peer, the rank too, by puts)."""
    from moeserve.dispatch import DispatchRows, ExpertPlacement, ep_dispatcher

    def parallel(*argv: str):
        args = parse(*argv)
        return EngineConfig.from_options(**{n: getattr(args, n) for n in args.engine_options}).parallel

    assert parallel("launch", "--ep", "8", "--nnodes", "2").load_store_ranks == 4
    config = parallel("launch", "--a2a-backend", "nvshmem", "--nvlink-domain-size", "1")
    assert config.load_store_ranks == 1
    rows = DispatchRows(hidden_size=8, top_k=2, dtype=torch.float32)
    dispatcher = ep_dispatcher(config, ExpertPlacement.contiguous(4), "cpu", None, rows)
    assert dispatcher.domain == 1
    with pytest.raises(ValueError, match="nvlink_domain_size must be a positive divisor of ep=4"):
        parallel("launch", "--ep", "4", "--nvlink-domain-size", "3")
    with pytest.raises(ValueError, match="nvlink_domain_size must be a positive divisor of ep=1, or 0"):
        parallel("launch", "--nvlink-domain-size", "-1")
    every_peer_by_puts = parallel("launch", "--a2a-backend", "nvshmem", "--nvlink-domain-size", "0")
    assert ep_dispatcher(every_peer_by_puts, ExpertPlacement.contiguous(4), "cpu", None, rows).domain == 0


def test_prefix_caching_is_on_unless_switched_off() -> None:
    def caching(*argv: str) -> bool:
        args = parse(*argv)
        config = EngineConfig.from_options(**{n: getattr(args, n) for n in args.engine_options})
        return config.cache.enable_prefix_caching

    assert caching("launch") is True
    assert caching("launch", "--no-enable-prefix-caching") is False
    assert caching("generate", "--prompt", "hi", "--no-enable-prefix-caching") is False
    assert caching("launch", "--no-enable-prefix-caching", "--enable-prefix-caching") is True
    assert EngineConfig.from_options(enable_prefix_caching=False).cache.enable_prefix_caching is False


def test_plan_prints_its_table_json_and_frontier(capsys, tmp_path) -> None:
    args = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--slo-tbt-ms", "50", "--no-disaggregate"]
    assert main([*args, "--top", "2", "--plot", str(tmp_path / "frontier.png")]) == 0
    out = capsys.readouterr().out
    assert "tok/s/GPU" in out and "TBT p99 ms" in out and "dominant" in out
    assert "figures measured: none" in out
    assert (tmp_path / "frontier.png").stat().st_size > 0
    assert main([*args, "--top", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tool"] == "moeserve plan" and len(doc["results"]) == 1
    assert doc["results"][0]["tbt_ms"]["p99"] <= 50
    assert doc["hardware"]["hbm_bw"]["source"] == "assumed"


def test_plan_refuses_an_unknown_model_in_one_line(caplog) -> None:
    assert main(["plan", "--model", "no-such-model", "--gpus", "8"]) == 2
    assert "known model" in caplog.text
