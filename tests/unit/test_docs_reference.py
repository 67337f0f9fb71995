"""The reference pages the docs site generates from the code (docs/hooks/reference.py): every
option and metric family has its text, and the pages list each one, under the names users type
and scrape."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moeserve.api.metrics import ServerMetrics
from moeserve.config import SLOConfig
from moeserve.engine_config import EngineConfig
from moeserve.options import options
from moeserve.server_config import ServerSettings

HOOK = Path(__file__).resolve().parents[2] / "docs" / "hooks" / "reference.py"


@pytest.fixture(scope="module")
def reference():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while being defined
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("config", [EngineConfig, ServerSettings], ids=lambda c: c.__name__)
def test_every_option_has_a_docstring(config: type) -> None:
    undocumented = [opt.name for opt in options(config) if not opt.help.strip()]
    assert undocumented == [], f"options of {config.__name__} with no field docstring"


def test_every_metric_family_has_help(reference) -> None:
    families = reference.metric_families()
    assert len(families) > 30
    assert [f.name for f in families if not f.help.strip()] == []


def test_configuration_page_lists_every_option(reference) -> None:
    page = reference.configuration_page()
    for config in (EngineConfig, ServerSettings):
        for opt in options(config):
            listed = f"### `{opt.flags[0]}`" in page
            assert listed != opt.meta.hidden, f"{opt.flags[0]}: listed {listed}, test-only {opt.meta.hidden}"


@pytest.mark.parametrize("per_expert", [False, True])
def test_metrics_page_names_every_series_a_scrape_shows(reference, per_expert: bool) -> None:
    """The series names are derived (a counter's `_total`, a histogram's three): a scrape's own
    names must all be among them."""
    page = reference.metrics_page()
    metrics = ServerMetrics("m", SLOConfig(), per_expert=per_expert)
    metrics.count_http("/v1/completions", 200)  # a labelled family shows series only once used
    scrape = generate_latest(metrics.registry).decode()
    scraped = {s.name for family in text_string_to_metric_families(scrape) for s in family.samples}
    documented = {name for family in reference.metric_families() for name in family.series}
    assert scraped - documented == set()
    for name in documented:
        assert f"`{name}`" in page


def test_help_text_markers_survive_markdown(reference) -> None:
    text = reference._markdown("reads <think>...</think> into `a|b` | c", in_table=True)
    assert text == "reads &lt;think&gt;...&lt;/think&gt; into `a|b` \\| c"


def test_command_line_page_has_every_command_help(reference) -> None:
    from moeserve.cli import build_parser

    page = reference.command_line_page()
    progs = [command.prog for command in reference.commands(build_parser())]
    assert {"moeserve launch", "moeserve generate", "moeserve bench serve", "moeserve plan"} <= set(progs)
    for prog in progs:
        assert f"## `{prog}`" in page and f"usage: {prog} " in page


def test_the_spec_decode_page_quotes_the_committed_results_file(reference) -> None:
    """The page's figures are the file's, rendered at build time: each case's target steps under
    its own drafter's name, its drafts, and its speedup with the verdict its spread allows."""
    page = (HOOK.parents[1] / "speculative-decoding.md").read_text()
    rendered = reference.on_page_markdown(page, None, None, None)
    results = json.loads(reference.SPEC_DECODE_RESULTS.read_text())
    assert set(results["cases"]) == {"repetitive", "random", "mtp"}
    for case, r in results["cases"].items():
        assert r["drafter"] == ("mtp" if case == "mtp" else "ngram")
        assert set(r["target_steps"]) == {r["drafter"], "none"}
        steps, tpot = r["target_steps"], r["tpot_speedup"]
        row = next(line for line in rendered.splitlines() if line.startswith(f"| {case} (`{r['drafter']}`)"))
        assert f"| {steps[r['drafter']]} / {steps['none']} |" in row
        assert f"of {r['num_draft_tokens']} |" in row
        assert row.endswith(f"{tpot['median']:.2f}x ({tpot['min']:.2f}x to {tpot['max']:.2f}x): {tpot['verdict']} |")
    assert "<!-- results:" not in rendered


@pytest.mark.parametrize(
    "per_round, verdict",
    [
        ([1.27, 1.36, 0.28], "within noise"),  # the 1.27x once reported as a speedup
        ([1.5, 1.6, 1.55], "faster"),
        ([0.5, 0.55, 0.6], "slower"),
        ([1.5, 1.6], "within noise"),  # two rounds: no spread to weigh it against
        ([1.1, 1.5, 1.2], "within noise"),  # 1.2x, but the rounds spread over 0.4
    ],
)
def test_a_speedup_is_claimed_only_where_it_exceeds_its_spread(reference, per_round, verdict) -> None:
    speedup = reference.bench_module("spec_decode").speedup(per_round)
    assert speedup["verdict"] == verdict
    assert (speedup["min"], speedup["max"]) == (min(per_round), max(per_round))
