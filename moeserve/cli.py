"""The `moeserve` command: `launch` (the OpenAI-compatible server), `generate`, `bench serve`
(the SLO load test), `make-model`, `eplb plan` (an expert placement from recorded loads) and
`plan` (size a deployment with a cost model before renting it)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path

from moeserve.engine_config import EngineConfig, ParallelConfig, check_rank_devices
from moeserve.loadtest.cli import add_bench_parser
from moeserve.options import Option, build, field_docs, options
from moeserve.plan.cli import add_plan_parser
from moeserve.router.cli import add_router_parser
from moeserve.server_config import ServerSettings

logger = logging.getLogger("moeserve.cli")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt (greedy by default)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (the engine's own seed is not a flag here)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help='print {"text": ..., "token_ids": [...]}')
    _add_engine_options(p, launch=False, exclude=("seed",))
    p.set_defaults(func=_run_generate)


def _env_default(opt: Option) -> object:
    """The first of the option's environment variables that is set, as the option's type."""
    for name in opt.meta.env:
        if os.environ.get(name, "").strip():
            if opt.type is bool:
                return os.environ[name].strip().lower() in ("1", "true", "yes", "on")
            return opt.type(os.environ[name])
    return None


def _flag_type(opt: Option) -> Callable[[str], object]:
    """What argparse converts the flag's text with; a ValueError becomes a usage error that says why."""
    parse = opt.meta.parse or opt.type

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = opt.type.__name__
    return convert


class _AppendToTuple(argparse.Action):
    """A repeatable flag whose values collect in a tuple, as the config field holds them (argparse's
    own "append" would extend a list default in place)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        setattr(namespace, self.dest, (*getattr(namespace, self.dest, ()), values))


def _add_engine_options(p: argparse.ArgumentParser, launch: bool, exclude: tuple[str, ...] = ()) -> None:
    """A flag for every `EngineConfig` option."""
    _add_config_flags(p, EngineConfig, "engine_options", launch, exclude)


def _add_config_flags(
    p: argparse.ArgumentParser, config: type, key: str, launch: bool, exclude: tuple[str, ...] = ()
) -> None:
    """A flag for every option of `config`: name, type, default and help from its field; the
    option names are kept under `key` so the command can build the config back from them."""
    parallel = None
    names = []
    for opt in options(config):
        if opt.name in exclude:
            continue
        default = opt.default
        if launch and opt.meta.launch_default is not None:
            default = opt.meta.launch_default
        # The help names the variables, never their values: one of them may hold a secret (the API key).
        shown = f"${' or $'.join(opt.meta.env)}, else {default}" if opt.meta.env else default
        env_value = _env_default(opt)
        default = env_value if env_value is not None else default
        hidden = argparse.SUPPRESS if opt.meta.hidden else f"{opt.help} (default: {shown})"
        group = p
        if opt.path[0] == "parallel":
            if parallel is None:
                parallel = p.add_argument_group(
                    "parallelism (one process per rank; torchrun's and Slurm's variables are defaults)"
                )
            group = parallel
        if opt.type is bool:  # a switch: --name turns it on, --no-name off
            group.add_argument(
                *opt.flags, dest=opt.name, action=argparse.BooleanOptionalAction, default=default, help=hidden
            )
        elif opt.meta.repeatable:
            group.add_argument(
                *opt.flags, dest=opt.name, type=_flag_type(opt), action=_AppendToTuple, default=default, help=hidden
            )
        else:
            group.add_argument(
                *opt.flags, dest=opt.name, type=_flag_type(opt), default=default, choices=opt.choices, help=hidden
            )
        names.append(opt.name)
    p.set_defaults(**{key: names})


def _engine_options(args: argparse.Namespace) -> dict[str, object]:
    return {name: getattr(args, name) for name in args.engine_options}


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None


def _run_generate(args: argparse.Namespace) -> int:
    from moeserve import LLM

    if args.node_rank > 0:
        raise ValueError("generate runs on node 0; start the other nodes with `moeserve launch --node-rank N`")
    with LLM(**_engine_options(args)) as llm:
        completion = _generate_one(llm, args)
    if args.json:
        print(
            json.dumps(
                {"text": completion.text, "token_ids": completion.token_ids, "finish_reason": completion.finish_reason}
            )
        )
    else:
        print(completion.text)
    return 0


def _generate_one(llm, args: argparse.Namespace):
    from moeserve import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if args.prompt_ids is not None:
        prompt: object = {"prompt_token_ids": _parse_ids(args.prompt_ids)}
    elif args.chat:
        tokenizer = llm.get_tokenizer()
        messages = [{"role": "user", "content": args.prompt}]
        prompt = {
            "prompt_token_ids": list(
                tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            )
        }
    else:
        prompt = args.prompt
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def _add_launch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="serve a model over an OpenAI-compatible HTTP API")
    _add_config_flags(p, ServerSettings, "server_options", launch=True)
    _add_engine_options(p, launch=True)
    p.set_defaults(func=_run_launch)


def _run_launch(args: argparse.Namespace) -> int:
    from moeserve.api.server import serve
    from moeserve.distributed.node_network import choose_node_network

    engine_options = _engine_options(args)
    if args.node_rank > 0:
        return _run_node(engine_options)
    settings = build(ServerSettings, {name: getattr(args, name) for name in args.server_options})
    settings = dataclasses.replace(settings, served_model_name=settings.model_name(args.model))
    config = EngineConfig.from_options(**engine_options)
    choose_node_network(config.parallel, os.environ)  # a node that cannot work refuses before it serves
    code = serve(settings, config)
    # The engine core is stopped, the grammar workers killed, the log written: skip the
    # interpreter's teardown, which (torch's and the tokenizers' native state) took 2-4 s of an
    # idle server's exit after "shut down cleanly", as the engine core skips its own.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_node(engine_options: dict[str, object]) -> int:
    """A machine other than node 0: its ranks only; node 0 tells them what to load."""
    from moeserve.distributed import run_node

    layout = build(ParallelConfig, {opt.name: engine_options[opt.name] for opt in options(ParallelConfig)})
    check_rank_devices(str(engine_options["device"]), layout)  # this node's GPUs; node 0 checked its own
    return run_node(layout)


def _spec_fields():
    from moeserve.checkpoints.spec import MakeModelSpec

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
    from moeserve.checkpoints.spec import SUPPORTED_ARCHS

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
        p.add_argument(
            flag,
            type=_arg_type(hint),
            default=default,
            choices=choices,
            help=f"{docs.get(f.name, '')} (default: {default})",
        )
    p.set_defaults(func=_run_make_model)


def _run_make_model(args: argparse.Namespace) -> int:
    from moeserve.checkpoints import make_model

    spec_cls, fields = _spec_fields()
    spec = spec_cls(**{f.name: getattr(args, f.name) for f, _ in fields})
    out = make_model(spec, args.out)
    print(out)
    return 0


def _add_eplb(sub: argparse._SubParsersAction) -> None:
    eplb = sub.add_parser("eplb", help="expert load balancing tools").add_subparsers(dest="eplb", required=True)
    p = eplb.add_parser(
        "plan", help="balance recorded expert loads (--record-expert-load) into an --expert-placement file"
    )
    p.add_argument("--loads", required=True, type=Path, help="a file written by --record-expert-load")
    p.add_argument("--ep", required=True, type=int, help="expert-parallel ranks the placement is for")
    p.add_argument("--num-redundant-experts", type=int, default=0, help="extra physical expert slots (R)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes the ranks span (hierarchical balancing)")
    p.add_argument("--out", required=True, type=Path, help="the placement file to write")
    p.set_defaults(func=_run_eplb_plan)


def _run_eplb_plan(args: argparse.Namespace) -> int:
    from moeserve.dispatch import ExpertMap
    from moeserve.eplb import balance, imbalance
    from moeserve.eplb.record import read_loads

    loads = read_loads(args.loads)
    if args.ep < 1 or args.num_redundant_experts < 0 or args.nnodes < 1:
        raise ValueError("--ep and --nnodes must be >= 1, --num-redundant-experts >= 0")
    num_experts = len(loads[0])
    planned = balance(loads, num_experts + args.num_redundant_experts, args.ep, args.nnodes)
    planned.save(args.out)
    before = imbalance(ExpertMap.default(num_experts, 0, args.ep, len(loads)), loads)
    after = imbalance(planned, loads)
    print(
        f"{args.out}: max/mean rank load {before[0]:.3f} (worst layer {before[1]:.3f}) contiguous -> "
        f"{after[0]:.3f} (worst {after[1]:.3f}) with {args.num_redundant_experts} redundant experts"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeserve", description="Inference server for Mixture-of-Experts LLMs")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_launch(sub)
    _add_generate(sub)
    add_bench_parser(sub)
    _add_make_model(sub)
    _add_eplb(sub)
    add_plan_parser(sub)
    add_router_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one line, no traceback
        logger.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
