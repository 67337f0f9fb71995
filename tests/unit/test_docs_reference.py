"""The reference pages the docs site generates from the code (docs/hooks/reference.py): every
option and metric family has its text, and the pages list each one, under the names users type
and scrape."""

from __future__ import annotations

import importlib.util
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
