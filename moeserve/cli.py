"""The `moeserve` command: `launch` (the OpenAI-compatible server), `generate`, `bench serve`
(the SLO load test) and `make-model`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
import typing
from pathlib import Path

from moeserve.config import field_docs
from moeserve.loadtest.cli import add_bench_parser

logger = logging.getLogger("moeserve.cli")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt (greedy by default)")
    p.add_argument("--model", help="Hugging Face checkpoint folder (default: the built-in demo model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16 or float16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--json", action="store_true", help='print {"text": ..., "token_ids": [...]}')
    p.add_argument("--kernels", choices=("auto", "torch", "triton"), default="auto", help="layer kernels: torch, triton, or auto (torch until the Triton kernels are verified on a GPU)")
    _add_parallel(p)
    p.set_defaults(func=_run_generate)


def _env_int(*names: str) -> int | None:
    for name in names:
        if os.environ.get(name, "").strip():
            return int(os.environ[name])
    return None


def _add_parallel(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (one process per rank; torchrun's and Slurm's variables are defaults)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel ranks: each holds 1/ep of the experts (default 1: one process)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size of attention inside each of the ep/tp data-parallel groups")
    g.add_argument("--nnodes", type=int, default=_env_int("NNODES", "SLURM_NNODES") or 1, help="machines the ranks span (default $NNODES or $SLURM_NNODES, else 1)")
    g.add_argument("--node-rank", type=int, default=_env_int("NODE_RANK", "GROUP_RANK", "SLURM_NODEID") or 0,
                   help="this machine's index; 0 serves the API, others only run ranks (default $NODE_RANK, $GROUP_RANK or $SLURM_NODEID)")
    g.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"), help="address of node 0 as the other nodes reach it (default $MASTER_ADDR)")
    g.add_argument("--master-port", type=int, default=_env_int("MASTER_PORT"),
                   help="node 0's rendezvous port (default $MASTER_PORT; a free one on a single node, 29500 across nodes)")
    g.add_argument("--distributed-backend", choices=("auto", "gloo", "nccl"), default="auto", help="collectives between ranks (auto: nccl on CUDA, gloo on CPU)")
    g.add_argument("--collective-timeout", type=float, default=120.0, help="seconds a rank waits in one collective before giving up")
    g.add_argument("--heartbeat-timeout", type=float, default=5.0, help="seconds of silence after which a rank is declared lost and the server stops")


def _parallel_kwargs(args: argparse.Namespace) -> dict:
    port = args.master_port if args.master_port is not None else (29500 if args.nnodes > 1 else 0)
    return dict(
        ep=args.ep, tp=args.tp, nnodes=args.nnodes, master_addr=args.master_addr, master_port=port,
        distributed_backend=args.distributed_backend, collective_timeout_s=args.collective_timeout, heartbeat_timeout_s=args.heartbeat_timeout,
    )


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None


def _run_generate(args: argparse.Namespace) -> int:
    from moeserve import LLM

    if args.node_rank > 0:
        raise ValueError("generate runs on node 0; start the other nodes with `moeserve launch --node-rank N`")
    with LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, kernels=args.kernels, **_parallel_kwargs(args)) as llm:
        completion = _generate_one(llm, args)
    if args.json:
        print(json.dumps({"text": completion.text, "token_ids": completion.token_ids, "finish_reason": completion.finish_reason}))
    else:
        print(completion.text)
    return 0


def _generate_one(llm, args: argparse.Namespace):
    from moeserve import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )
    if args.prompt_ids is not None:
        prompt: object = {"prompt_token_ids": _parse_ids(args.prompt_ids)}
    elif args.chat:
        tokenizer = llm.get_tokenizer()
        messages = [{"role": "user", "content": args.prompt}]
        prompt = {"prompt_token_ids": list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))}
    else:
        prompt = args.prompt
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def _add_launch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", help="Hugging Face checkpoint folder (default: the built-in demo model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (the log says which)")
    p.add_argument("--served-model-name", help="model id clients send and /v1/models lists (default: the --model path, or 'moeserve-demo')")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16 or float16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kernels", choices=("auto", "torch", "triton"), default="auto", help="layer kernels: torch, triton, or auto (torch until the Triton kernels are verified on a GPU)")
    _add_parallel(p)
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion (default: the checkpoint's)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in the running batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="per-step token budget shared by prefill chunks and decodes")
    p.add_argument("--block-size", type=int, default=16, help="tokens per paged KV block")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-blocks", type=int, default=None, help="KV cache size in blocks")
    kv.add_argument("--kv-cache-memory", type=_parse_bytes, default=512 * 1024**2, help="KV cache size in bytes, e.g. 512MiB or 4GiB (default 512MiB)")
    p.add_argument("--max-waiting", type=int, default=1024, help="most queued requests; beyond it requests get 429 with Retry-After")
    p.add_argument("--scheduling-policy", choices=("fcfs", "slo"), default="fcfs",
                   help="fcfs: arrival order, full prefill chunks; slo: prefill chunks sized so decodes keep the TBT target, TTFT-deadline order")
    p.add_argument("--slo-ttft-ms", type=float, default=5000.0, help="time-to-first-token target (ms), for the slo policy and /metrics attainment")
    p.add_argument("--slo-tbt-ms", type=float, default=25.0, help="time-between-tokens target (ms), for the slo policy and /metrics attainment")
    p.add_argument("--api-key", default=os.environ.get("MOESERVE_API_KEY"), help="require 'Authorization: Bearer KEY' on /v1 routes (default: $MOESERVE_API_KEY)")
    p.add_argument("--max-request-body", type=_parse_bytes, default=16 * 1024**2, help="largest request body in bytes (413 beyond; default 16MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds running requests get to finish after SIGTERM")
    p.add_argument("--seed", type=int, default=0)
    # Test-only: a server of known capacity for load-test harness checks.
    p.add_argument("--debug-min-step-time-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    p.set_defaults(func=_run_launch)


_UNITS = {"": 1, "b": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "kb": 1000, "mb": 1000**2, "gb": 1000**3}


def _parse_bytes(text: str) -> int:
    """'512MiB', '4GiB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512MiB, 4GiB or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _run_launch(args: argparse.Namespace) -> int:
    from moeserve.api.server import ServerSettings, serve
    from moeserve.config import SLOConfig

    if args.node_rank > 0:
        return _run_node(args)

    slo = SLOConfig(ttft_s=args.slo_ttft_ms / 1000.0, tbt_s=args.slo_tbt_ms / 1000.0)
    settings = ServerSettings(
        served_model_name=args.served_model_name or args.model or "moeserve-demo",
        api_key=args.api_key or None,
        max_body_bytes=args.max_request_body,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    engine_kwargs = dict(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, **_parallel_kwargs(args),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_blocks=args.kv_cache_blocks, kv_cache_memory=args.kv_cache_memory, seed=args.seed,
        scheduling_policy=args.scheduling_policy, slo_ttft_ms=args.slo_ttft_ms, slo_tbt_ms=args.slo_tbt_ms, max_waiting=args.max_waiting,
        min_step_time_ms=args.debug_min_step_time_ms, kernels=args.kernels,
    )
    return serve(settings, args.host, args.port, engine_kwargs, slo)


def _run_node(args: argparse.Namespace) -> int:
    """A machine other than node 0: its ranks only; node 0 tells them what to load."""
    from moeserve.distributed import run_node
    from moeserve.llm import parallel_config

    return run_node(parallel_config(**_parallel_kwargs(args), node_rank=args.node_rank))


def _spec_fields():
    from moeserve.checkpoints import MakeModelSpec

    hints = typing.get_type_hints(MakeModelSpec)
    return MakeModelSpec, [(f, hints[f.name]) for f in dataclasses.fields(MakeModelSpec)]


def _arg_type(hint: object) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return str
    if args and typing.get_origin(hint) is not typing.Literal:
        return _arg_type(args[0])
    return hint if hint in (int, float) else str


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    from moeserve.checkpoints import SUPPORTED_ARCHS

    p = sub.add_parser("make-model", help="write a tiny random-weight checkpoint in Hugging Face layout")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    spec_cls, fields = _spec_fields()
    docs = field_docs(spec_cls)
    for f, hint in fields:
        flag = "--" + f.name.replace("_", "-")
        if f.name == "arch":
            p.add_argument(flag, required=True, choices=SUPPORTED_ARCHS)
            continue
        default = None if f.default is dataclasses.MISSING else f.default
        choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
        p.add_argument(flag, type=_arg_type(hint), default=default, choices=choices, help=f"{docs.get(f.name, '')} (default: {default})")
    p.set_defaults(func=_run_make_model)


def _run_make_model(args: argparse.Namespace) -> int:
    from moeserve.checkpoints import make_model

    spec_cls, fields = _spec_fields()
    spec = spec_cls(**{f.name: getattr(args, f.name) for f, _ in fields})
    out = make_model(spec, args.out)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeserve", description="Inference server for Mixture-of-Experts LLMs")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_launch(sub)
    _add_generate(sub)
    add_bench_parser(sub)
    _add_make_model(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one line, no traceback
        logger.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
