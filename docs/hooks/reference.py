"""MkDocs hook: the configuration, metrics and command-line reference pages, written from the code
at every build, and the measured results pages quote, written from the committed results files.

Hand-kept tables of flags and metric names drift from the code within weeks; these are rendered from
the same sources the program uses: the documented fields of the config dataclasses (which also make
`moeserve launch`'s flags and `LLM(...)`'s keywords, see `moeserve.options`) and the families the
server's metrics registry holds. Hand-copied benchmark figures drift from the results files as soon
as a benchmark is re-run; a page marks where a file's results go (`RESULTS`) and the benchmark's
own `report` renders them there. tests/unit/test_docs_reference.py checks that each has its text.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

from moeserve.engine_config import EngineConfig
from moeserve.options import Option, options
from moeserve.server_config import ServerSettings

ROOT = Path(__file__).resolve().parents[2]

# The option's first path element -> the section it is listed under; top-level fields have a
# one-element path and fall under "engine".
_ENGINE_SECTIONS = {
    "engine": "Engine",
    "cache": "KV cache",
    "parallel": "Parallelism (expert, tensor, data; several nodes)",
    "eplb": "Expert load balancing",
    "cuda_graphs": "CUDA graphs",
    "slo": "SLOs",
    "structured_outputs": "Structured outputs",
    "kv_transfer": "Prefill/decode disaggregation (KV transfer)",
}


def _markdown(text: str, in_table: bool = False) -> str:
    """Field and metric docs as Markdown text: outside code spans their `<think>`-like markers would
    be read as HTML tags and vanish, and inside a table a `|` would end the cell."""
    pieces = text.split("`")
    for i in range(0, len(pieces), 2):  # the even pieces lie outside code spans
        pieces[i] = pieces[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        if in_table:
            pieces[i] = pieces[i].replace("|", "\\|")
    return "`".join(pieces)


def _section(opt: Option) -> str:
    if len(opt.path) == 1:
        return "engine"
    return "eplb" if "eplb" in opt.path else opt.path[0]


def _shown(value: object) -> str:
    if value is dataclasses.MISSING:
        return "required"
    if value is None:
        return "none"
    if value == ():
        return "none (repeat the flag to add)"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def _kind(opt: Option) -> str:
    if opt.choices:
        kind = " \\| ".join(f"`{c}`" for c in opt.choices)
    elif opt.type is bool:
        kind = "switch (`--name` / `--no-name`)"
    else:
        kind = opt.type.__name__
    return kind + (", or none" if opt.optional and opt.type is not bool else "")


def _option_entry(opt: Option, keyword: bool) -> str:
    flags = ", ".join(f"`{f}`" for f in opt.flags)
    lines = [f"### `{opt.flags[0]}` {{#{opt.name.replace('_', '-')}}}", "", _markdown(opt.help), ""]
    lines.append(f"- flag: {flags}")
    if keyword:
        lines.append(f"- `LLM(...)` keyword: `{opt.name}`")
    lines.append(f"- type: {_kind(opt)}")
    default = f"- default: {_shown(opt.default)}"
    if opt.meta.launch_default is not None:
        default += f" (`moeserve launch`: {_shown(opt.meta.launch_default)})"
    lines.append(default)
    if opt.meta.env:
        lines.append("- default from the environment: " + ", then ".join(f"`${name}`" for name in opt.meta.env))
    return "\n".join(lines) + "\n"


def configuration_page() -> str:
    """Every server and engine option, grouped as `moeserve launch --help` groups them."""
    parts = [
        "# Configuration reference",
        "",
        "Generated from the documented fields of `moeserve/server_config.py` and `moeserve/engine_config.py` "
        "when this site is built, so it lists exactly what this version accepts. Every engine option is a flag "
        "of `moeserve launch` and `moeserve generate` (dashes for underscores) and a keyword of `LLM(...)`; "
        "server options are flags of `moeserve launch` only. `moeserve launch --help` prints the same text.",
        "",
        "## Server (`moeserve launch`)",
        "",
    ]
    parts += [_option_entry(opt, keyword=False) for opt in options(ServerSettings) if not opt.meta.hidden]
    engine = [opt for opt in options(EngineConfig) if not opt.meta.hidden]
    for key, title in _ENGINE_SECTIONS.items():
        listed = [opt for opt in engine if _section(opt) == key]
        if listed:
            parts += [f"## {title}", ""]
            parts += [_option_entry(opt, keyword=True) for opt in listed]
    unlisted = {_section(opt) for opt in engine} - set(_ENGINE_SECTIONS)
    if unlisted:
        raise ValueError(f"engine options under {sorted(unlisted)} have no section in the configuration reference")
    return "\n".join(parts)


@dataclasses.dataclass(frozen=True)
class MetricFamily:
    name: str
    kind: str
    help: str
    labels: tuple[str, ...]
    per_expert_labels: tuple[str, ...]
    """The labels under --per-expert-metrics (some families trade an aggregate for a label)."""

    @property
    def series(self) -> tuple[str, ...]:
        """The names a scrape shows, as Prometheus' text format suffixes them."""
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(self.kind, ("",))
        return tuple(self.name + s for s in suffixes)


def _registry_families(per_expert: bool) -> Iterator[tuple[str, str, str, tuple[str, ...]]]:
    from moeserve.api.metrics import ServerMetrics
    from moeserve.config import SLOConfig

    registry = ServerMetrics("MODEL", SLOConfig(), per_expert=per_expert).registry
    # prometheus_client's own collectors know their label names before any series exists; the
    # registry lists its collectors only privately, and a changed name fails the docs test.
    for collector in list(registry._collector_to_names):
        for family in collector.collect():
            labels = getattr(collector, "_labelnames", None)
            if labels is None:  # a collector of our own: its label names are on its samples
                labels = tuple(dict.fromkeys(k for s in family.samples for k in s.labels if k != "le"))
            yield family.name, family.type, family.documentation, tuple(labels)


def metric_families() -> list[MetricFamily]:
    """Every family the server's /metrics exports, in registration order."""
    per_expert = {name: labels for name, _, _, labels in _registry_families(per_expert=True)}
    return [
        MetricFamily(name, kind, doc, labels, per_expert.get(name, labels))
        for name, kind, doc, labels in _registry_families(per_expert=False)
    ]


def _labels(family: MetricFamily) -> str:
    shown = ", ".join(f"`{label}`" for label in family.labels) or "none"
    if family.per_expert_labels != family.labels:
        shown += "; with `--per-expert-metrics`: " + ", ".join(f"`{label}`" for label in family.per_expert_labels)
    return shown


def metrics_page() -> str:
    """The metric families as a table, then the metrics module's own account of how to read them."""
    from moeserve.api import metrics

    rows = [
        "| series | type | labels | meaning |",
        "|---|---|---|---|",
    ]
    for family in metric_families():
        series = "<br>".join(f"`{s}`" for s in family.series)
        rows.append(f"| {series} | {family.kind} | {_labels(family)} | {_markdown(family.help, in_table=True)} |")
    return "\n".join(
        [
            "# Metrics reference",
            "",
            "Generated from the server's metrics registry (`moeserve/api/metrics.py`) when this site is built: "
            "every family `GET /metrics` exports, in Prometheus' text format. Names follow vLLM's with "
            "`moeserve:` for `vllm:`. No `_created` series are exported.",
            "",
            *rows,
            "",
            "## Reading them",
            "",
            _markdown(inspect.cleandoc(metrics.__doc__ or "")),
            "",
        ]
    )


HELP_WIDTH = 100
"""Columns of the help text on the page: argparse would otherwise wrap at the building terminal's width."""


def commands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every leaf command under `parser` (`moeserve launch`, `moeserve bench serve`, ...)."""
    for action in parser._actions:  # argparse lists its subcommands on its (private) actions only
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                nested = list(commands(sub))
                yield from nested or [sub]


def command_line_page() -> str:
    """Each command's `--help`, as the command itself prints it."""
    from moeserve.cli import build_parser

    parts = [
        "# Command line",
        "",
        "Generated from the `moeserve` command's own parsers when this site is built: each command's "
        "`--help`. What the engine and server options mean, in full: the [configuration reference](configuration.md).",
        "",
    ]
    for command in commands(build_parser()):
        formatter = command.formatter_class
        command.formatter_class = lambda prog, formatter=formatter: formatter(prog, width=HELP_WIDTH)
        parts += [f"## `{command.prog}`", "", "```text", command.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


PAGES: dict[str, Callable[[], str]] = {
    "reference/configuration.md": configuration_page,
    "reference/metrics.md": metrics_page,
    "reference/command-line.md": command_line_page,
}


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """MkDocs calls this once the docs folder is read: the reference pages join the files to build."""
    for path, render in PAGES.items():
        files.append(File.generated(config, path, content=render()))
    return files


def bench_module(name: str) -> ModuleType:
    """The script bench/`name`.py as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


SPEC_DECODE_RESULTS = ROOT / "bench" / "results" / "spec_decode.json"


def spec_decode_results() -> str:
    """bench/results/spec_decode.json, as bench/spec_decode.py itself reports it."""
    results = json.loads(SPEC_DECODE_RESULTS.read_text())
    return bench_module("spec_decode").report(results)


RESULTS: dict[str, Callable[[], str]] = {
    "<!-- results: bench/results/spec_decode.json -->": spec_decode_results,
}
"""A marker a page holds -> the results that replace it when the site is built."""


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """MkDocs calls this with each page's Markdown: a results marker becomes its results."""
    for marker, render in RESULTS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return markdown
