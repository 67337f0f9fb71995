"""The Grafana dashboard and the Prometheus rules in deploy/ query only series the server exports.

Every PromQL expression (panels, template variables, annotations, alert rules) is parsed with a
real PromQL parser, so a syntax error fails here rather than as an empty panel, and each metric it
names must be a series of the server's registry: `_total` for counters, `_bucket`/`_sum`/`_count`
for histograms, carrying every label a matcher, a `by` or a legend names. The registry is listed
from `ServerMetrics` itself, since the expert-parallel and EPLB families carry no series until a
multi-rank server routes tokens or rebalances; a real server's /metrics is checked against that
listing, and for the `_created` series it must not have.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from server_utils import ServerProcess

from moeserve.api.metrics import ServerMetrics
from moeserve.config import SLOConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "moeserve-dashboard.json"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY / "prometheus" / "moeserve-alerts.yml"

GRAFANA_INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b")
LABEL_VALUES = re.compile(r"^label_values\((.+),\s*(\w+)\)$")
SERIES_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
COUNTER_FUNCTIONS = {"rate", "irate", "increase"}  # meaningless on a gauge: they assume resets are restarts
PROMETHEUS_SERIES = {"up"}  # written by Prometheus for each scrape, not by the server


def registry_series(metrics: ServerMetrics) -> dict[str, str]:
    """Every series name the registry can export, with the type of its family."""
    return {
        family.name + suffix: family.type
        for family in metrics.registry.collect()
        for suffix in SERIES_SUFFIXES[family.type]
    }


def registry_labels(metrics: ServerMetrics) -> dict[str, set[str]]:
    """Each family's label names, from its samples or, for a labelled family with no child yet
    (no samples to read), from the collector's declared names (`_labelnames`)."""
    labels = {
        family.name: {key for s in family.samples for key in s.labels} - {"le"} for family in metrics.registry.collect()
    }
    for collector in metrics.registry._collector_to_names:
        if hasattr(collector, "_labelnames"):
            labels[collector._name].update(collector._labelnames)
    return labels


METRICS = ServerMetrics("m", SLOConfig())
EXPORTED = registry_series(METRICS)
FAMILY_LABELS = registry_labels(METRICS)
TARGET_LABELS = {"job", "instance"}  # Prometheus adds them to every series it scrapes
LEGEND_LABELS = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def series_labels(name: str) -> set[str]:
    """The labels a series carries once scraped; `up` has only the target's."""
    for suffix, extra in (("_bucket", {"le"}), ("_sum", set()), ("_count", set()), ("_total", set()), ("", set())):
        family = name.removesuffix(suffix)
        if name.endswith(suffix) and family in FAMILY_LABELS:
            return FAMILY_LABELS[family] | TARGET_LABELS | extra
    return set(TARGET_LABELS)


def dashboard_queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every query of the dashboard; `label_values(selector, label)` variables
    give their selector."""
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = LABEL_VALUES.match(variable["query"]["query"])
            assert match, f"variable {variable['name']}: not a label_values(selector, label) query"
            yield f"variable {variable['name']!r}", match.group(1)
    for annotation in dashboard["annotations"]["list"]:
        yield f"annotation {annotation['name']!r}", annotation["expr"]


def alert_queries() -> Iterator[tuple[str, str]]:
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            yield f"rule {rule['alert']!r}", rule["expr"]


QUERIES = [*dashboard_queries(), *alert_queries()]


def parse(query: str) -> promql_parser.Expr:
    """Grafana's interval variables become a duration; the others stand inside label matchers'
    strings, where PromQL takes any text."""
    return promql_parser.parse(GRAFANA_INTERVALS.sub("5m", query))


def children(node: promql_parser.Expr) -> list[promql_parser.Expr]:
    if isinstance(node, promql_parser.BinaryExpr):
        return [node.lhs, node.rhs]
    if isinstance(node, promql_parser.AggregateExpr):
        return [node.expr] + ([node.param] if node.param is not None else [])
    if isinstance(node, promql_parser.Call):
        return list(node.args)
    if isinstance(node, promql_parser.MatrixSelector):
        return [node.vector_selector]
    if isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
        return [node.expr]
    return []  # selectors and literals


def walk(node: promql_parser.Expr) -> Iterator[promql_parser.Expr]:
    yield node
    for child in children(node):
        yield from walk(child)


def selector_names(node: promql_parser.Expr) -> list[str]:
    return [n.name for n in walk(node) if isinstance(n, promql_parser.VectorSelector)]


def test_every_deploy_file_has_queries() -> None:
    """The extraction itself: a dashboard or rules file read as empty would pass every test below."""
    assert sum(where.startswith("panel") for where, _ in QUERIES) >= 30
    assert sum(where.startswith("rule") for where, _ in QUERIES) >= 6


@pytest.mark.parametrize("where,query", QUERIES, ids=[where for where, _ in QUERIES])
def test_query_parses_and_names_exported_series(where: str, query: str) -> None:
    tree = parse(query)  # raises ValueError on a syntax error
    names = selector_names(tree)
    assert names, f"{where}: selects no metric"
    for name in names:
        assert name, f"{where}: a selector without a metric name"
        assert name in EXPORTED or name in PROMETHEUS_SERIES, f"{where}: {name} is not a series the server exports"


@pytest.mark.parametrize("where,query", QUERIES, ids=[where for where, _ in QUERIES])
def test_rates_are_taken_of_counters(where: str, query: str) -> None:
    """rate/increase of a gauge is a number with no meaning, and quantiles need the buckets."""
    for node in walk(parse(query)):
        if not isinstance(node, promql_parser.Call):
            continue
        series = [name for arg in node.args for name in selector_names(arg)]
        if node.func.name in COUNTER_FUNCTIONS:
            for name in series:
                assert EXPORTED.get(name) in ("counter", "histogram"), f"{where}: {node.func.name}() of {name}"
        if node.func.name == "histogram_quantile":
            assert series and all(name.endswith("_bucket") for name in series), f"{where}: quantile of {series}"


@pytest.mark.parametrize("where,query", QUERIES, ids=[where for where, _ in QUERIES])
def test_labels_exist_on_the_series(where: str, query: str) -> None:
    """A misspelt label in a matcher or a `by` selects nothing or merges every series, silently."""
    for node in walk(parse(query)):
        if isinstance(node, promql_parser.VectorSelector):
            for matcher in node.matchers.matchers:
                assert matcher.name in series_labels(node.name), f"{where}: {node.name} has no label {matcher.name}"
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            available = set().union(*(series_labels(name) for name in selector_names(node.expr)))
            missing = set(node.modifier.labels) - available
            assert not missing, f"{where}: {node.modifier} names labels its series lack: {missing}"


def test_legends_name_labels_of_their_query() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            available = set().union(*(series_labels(name) for name in selector_names(parse(target["expr"]))))
            for label in LEGEND_LABELS.findall(target.get("legendFormat", "")):
                assert label in available, f"panel {panel['title']!r} {target['refId']}: legend names {label}"


def test_dashboard_panels_have_unique_ids_and_a_datasource() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_up_rules_name_the_scrape_job() -> None:
    """`up{job=...}` only matches the job name the scrape config gives."""
    jobs = {job["job_name"] for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]}
    assert yaml.safe_load(PROMETHEUS.read_text())["rule_files"] == [ALERTS.name]
    for where, query in QUERIES:
        for node in walk(parse(query)):
            if isinstance(node, promql_parser.VectorSelector) and node.name == "up":
                job = [m.value for m in node.matchers.matchers if m.name == "job"]
                assert job and job[0] in jobs, f"{where}: up{{job={job}}} is no scrape job of {sorted(jobs)}"


@pytest.fixture(scope="module")
def exposition(start_server: Callable[..., ServerProcess]) -> str:
    """/metrics of a default server (per-expert metrics off), after one request."""
    server = start_server("--no-per-expert-metrics")
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    server.stop()
    return text


def test_server_exposition_is_the_registry_listing(exposition: str) -> None:
    served = {sample.name for family in text_string_to_metric_families(exposition) for sample in family.samples}
    assert not [name for name in served if name.endswith("_created")]
    assert served <= set(EXPORTED), served - set(EXPORTED)
    moeserve = {name for name in served if name.startswith("moeserve:")}
    listed_with_series = {
        sample.name for family in ServerMetrics("m", SLOConfig()).registry.collect() for sample in family.samples
    }
    assert listed_with_series <= moeserve, listed_with_series - moeserve  # the listing is what a server exports


def test_a_one_group_model_labels_its_blocks_full(exposition: str) -> None:
    """The per-group block gauges come through the core process's frames: one group, `full`,
    holding every block of the unlabelled total."""
    samples = [s for family in text_string_to_metric_families(exposition) for s in family.samples]
    totals = {s.labels["group"]: s.value for s in samples if s.name == "moeserve:kv_cache_group_blocks_total"}
    assert totals == {"full": next(s.value for s in samples if s.name == "moeserve:kv_cache_blocks_total")}
    assert totals["full"] > 0
