"""A whole `bench serve` session: prompts, warm-up, the runs the mode calls for, the document.

Modes: one run at `request_rate`; a sweep over `sweep_rates`; or a search for the highest rate
whose attainment of every objective reaches `slo_attainment`. Every run replays the same prompts
and the same (scaled) arrival pattern, so rates differ in nothing but rate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from moeserve.loadtest import promcheck
from moeserve.loadtest.client import ENDPOINTS, RequestRecord, RequestSettings, aiohttp_opener, send_request
from moeserve.loadtest.datasets import Prompt, jsonl_prompts, random_prompts, sharegpt_prompts
from moeserve.loadtest.metrics import Objectives, request_metrics, summarize_run
from moeserve.loadtest.promcheck import CrossCheck, MetricsUnavailable
from moeserve.loadtest.report import document, json_rate, search_json
from moeserve.loadtest.runner import LoadSettings, RunReport, run_at_rate
from moeserve.loadtest.search import SearchResult, SearchSettings, find_max_rate
from moeserve.loadtest.slo_mix import ClassCounts, MixClass, assign_classes, class_reports, parse_class_counters

logger = logging.getLogger("moeserve.loadtest")

# Failures of requests that never reached the server's engine: its SLO counters miss them.
_NOT_ADMITTED = ("http_4xx", "http_5xx", "connection_error")


@dataclass(frozen=True)
class BenchConfig:
    """Everything a benchmark session needs; the CLI flags map onto it one to one."""

    base_url: str
    """The server's root, e.g. http://127.0.0.1:8000 (a trailing /v1 is dropped)."""
    model: str | None = None
    """None: the first model the server lists at /v1/models."""
    endpoint: str = "completions"
    dataset_name: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    """Also max_tokens for jsonl lines without output_len."""
    random_range_ratio: float = 0.0
    random_vocab_size: int = 300
    tokenizer: str | None = None
    """A Hugging Face tokenizer to count tokens when the server sends no usage (and for ShareGPT lengths)."""
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    objectives: Objectives = field(default_factory=Objectives)
    sweep_rates: tuple[float, ...] = ()
    find_max_goodput_rate: bool = False
    slo_attainment: float = 0.99
    search_start_rate: float = 1.0
    search_tolerance: float = 0.05
    search_max_probes: int = 16
    ignore_eos: bool = False
    seed: int = 0
    api_key: str | None = field(default=None, repr=False)
    timeout_s: float = 300.0
    duration_s: float = 3600.0
    warmup_requests: int = 0
    cross_check: bool = True
    progress: bool = True
    slo_mix: tuple[MixClass, ...] = ()
    """SLO classes to draw each request's `slo` field from (`--slo-mix`); each is reported on its own."""

    def __post_init__(self) -> None:
        url = self.base_url.rstrip("/")
        object.__setattr__(self, "base_url", url.removesuffix("/v1"))
        problems = [
            (self.endpoint not in ENDPOINTS, f"endpoint must be one of {', '.join(ENDPOINTS)}"),
            (
                self.dataset_name not in ("random", "jsonl", "sharegpt"),
                "dataset_name must be random, jsonl or sharegpt",
            ),
            (
                self.dataset_name != "random" and not self.dataset_path,
                f"--dataset-name {self.dataset_name} needs --dataset-path",
            ),
            (self.num_prompts < 1, "--num-prompts must be at least 1"),
            (
                self.random_input_len < 1 or self.random_output_len < 1,
                "--random-input-len and --random-output-len must be at least 1",
            ),
            (not 0 <= self.random_range_ratio < 1, "--random-range-ratio must be in [0, 1)"),
            (not self.request_rate > 0, "--request-rate must be positive (or inf)"),
            (not self.burstiness > 0, "--burstiness must be positive"),
            (self.max_concurrency is not None and self.max_concurrency < 1, "--max-concurrency must be at least 1"),
            (any(not (0 < r < math.inf) for r in self.sweep_rates), "--sweep-rates must be positive finite rates"),
            (
                bool(self.sweep_rates) and self.find_max_goodput_rate,
                "--sweep-rates and --find-max-goodput-rate exclude each other",
            ),
            (
                self.find_max_goodput_rate and not self.objectives.given(),
                "--find-max-goodput-rate needs --goodput objectives",
            ),
            (not 0 < self.slo_attainment <= 1, "--slo-attainment must be in (0, 1]"),
            (not 0 < self.search_start_rate < math.inf, "--search-start-rate must be a positive finite rate"),
            (not self.search_tolerance > 0, "--search-tolerance must be positive"),
            (self.search_max_probes < 2, "--search-max-probes must be at least 2"),
            (not self.timeout_s > 0 or not self.duration_s > 0, "--timeout and --duration must be positive"),
            (self.warmup_requests < 0, "--warmup-requests must be >= 0"),
        ]
        errors = [message for bad, message in problems if bad]
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def mode(self) -> str:
        return "search" if self.find_max_goodput_rate else "sweep" if self.sweep_rates else "single"

    def as_json(self) -> dict[str, Any]:
        """The settings for the result file; the API key is left out."""
        data = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("api_key", "objectives", "progress")
        }
        data["request_rate"] = json_rate(self.request_rate)
        data["sweep_rates"] = list(self.sweep_rates)
        data["goodput_objectives_ms"] = {kind: target * 1000.0 for kind, target in self.objectives.given().items()}
        data["slo_mix"] = [
            {"name": c.name, "weight": c.weight, "ttft_ms": c.targets_ms[0], "tbt_ms": c.targets_ms[1]}
            for c in self.slo_mix
        ]
        return data


@dataclass
class BenchResult:
    reports: list[RunReport]
    """Every run in the order it ran (a search's probes included)."""
    search: SearchResult | None
    document: dict[str, Any]
    """The JSON result file's content."""


def load_prompts(config: BenchConfig, count_tokens: Callable[[str], int] | None) -> list[Prompt]:
    """The prompts of every run; ValueError for a dataset the endpoint cannot take."""
    if config.dataset_name == "random":
        return random_prompts(
            config.num_prompts,
            config.random_input_len,
            config.random_output_len,
            config.random_range_ratio,
            config.random_vocab_size,
            config.seed,
            as_text=config.endpoint == "chat",
        )
    path = Path(config.dataset_path)
    if config.dataset_name == "jsonl":
        prompts = jsonl_prompts(path, config.num_prompts, config.random_output_len)
    else:
        prompts = sharegpt_prompts(path, config.num_prompts, config.seed, count_tokens)
    if config.endpoint == "chat" and any(not isinstance(p.prompt, str) for p in prompts):
        raise ValueError(f"{path} has token-id prompts; the chat endpoint takes text only")
    return prompts


def _token_counter(name: str | None) -> Callable[[str], int] | None:
    if name is None:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


async def _first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The id of the first model the server lists, as vLLM's benchmark picks it."""
    try:
        async with session.get(f"{base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as response:
            body = await response.json(content_type=None) if response.status == 200 else None
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as e:
        raise ValueError(
            f"cannot list models at {base_url}/v1/models ({type(e).__name__}: {e}); is the server up? (or pass --model)"
        ) from None
    models = body.get("data") if isinstance(body, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


class _Session:
    """The pieces every run of a benchmark shares: HTTP session, prompts, settings."""

    def __init__(
        self,
        config: BenchConfig,
        http: aiohttp.ClientSession,
        settings: RequestSettings,
        prompts: list[Prompt],
        count_tokens: Callable[[str], int] | None,
        on_run: Callable[[RunReport], None] | None,
        class_of: list[int],
    ) -> None:
        self.config = config
        self.class_of = class_of
        self.http = http
        self.prompts = prompts
        self.on_run = on_run
        opener = aiohttp_opener(http, config.base_url)
        self.load = LoadSettings(config.burstiness, config.max_concurrency, config.duration_s, config.seed)

        async def send(index: int, prompt: Prompt) -> RequestRecord:
            return await send_request(opener, settings, index, prompt, count_tokens=count_tokens)

        self.send = send
        self.reports: list[RunReport] = []

    async def warm_up(self) -> None:
        """Requests before the first run, one at a time, measured by nobody (caches, lazy init)."""
        for i in range(self.config.warmup_requests):
            record = await self.send(-1 - i, self.prompts[i % len(self.prompts)])
            if record.error is not None:
                logger.warning("warm-up request %d failed: %s %s", i, record.error, record.error_detail)

    async def _class_counters(self) -> dict[str, ClassCounts] | None:
        """The server's per-class SLO counters now; None when /metrics cannot give them."""
        try:
            return parse_class_counters(await promcheck.read_metrics_text(self.http, self.config.base_url))
        except (MetricsUnavailable, ValueError) as e:
            logger.warning("per-class SLO counters unavailable: %s", e)
            return None

    async def run(self, rate: float) -> RunReport:
        """One run at `rate`, measured, with the server's counters read around it."""
        before, skip_reason = None, "disabled (--no-cross-check)"
        if self.config.cross_check:
            try:
                before = await promcheck.read_slo_counters(self.http, self.config.base_url)
            except MetricsUnavailable as e:
                skip_reason = str(e)
        classes_before = await self._class_counters() if before is not None and self.config.slo_mix else None
        result = await run_at_rate(self.send, self.prompts, rate, self.load, progress=self.config.progress)
        requests = [request_metrics(r, result.start_time) for r in result.records]
        summary = summarize_run(requests, self.config.objectives, result.duration_s)
        cross = CrossCheck.skipped(skip_reason)
        class_deltas = None
        if before is not None:
            admitted = sum(m.error not in _NOT_ADMITTED for m in requests)
            try:
                after = await promcheck.settle(self.http, self.config.base_url, before, admitted)
                cross = promcheck.compare(before, after, requests)
            except MetricsUnavailable as e:
                cross = CrossCheck.skipped(str(e))
            classes_after = await self._class_counters() if classes_before is not None else None
            if classes_after is not None:
                class_deltas = {k: v.minus(classes_before.get(k, ClassCounts())) for k, v in classes_after.items()}
        classes = ()
        if self.config.slo_mix:
            classes = class_reports(self.config.slo_mix, self.class_of, requests, result.duration_s, class_deltas)
        report = RunReport(rate, len(self.prompts), requests, summary, cross, classes)
        self.reports.append(report)
        if self.on_run is not None:
            self.on_run(report)
        return report


async def bench_serve(config: BenchConfig, on_run: Callable[[RunReport], None] | None = None) -> BenchResult:
    """Run the benchmark `config` describes against a live server; `on_run` sees each run as it ends."""
    count_tokens = _token_counter(config.tokenizer)
    prompts = load_prompts(config, count_tokens)
    class_of = assign_classes(len(prompts), config.slo_mix, config.seed) if config.slo_mix else []
    if config.slo_mix:
        prompts = [dataclasses.replace(p, slo_ms=config.slo_mix[c].targets_ms) for p, c in zip(prompts, class_of)]
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # No connection limit beyond --max-concurrency: aiohttp's default of 100 would be a hidden cap.
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0)
    async with aiohttp.ClientSession(
        headers=headers, connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as http:
        model = config.model or await _first_model(http, config.base_url)
        settings = RequestSettings(config.endpoint, model, config.ignore_eos, config.timeout_s)
        session = _Session(config, http, settings, prompts, count_tokens, on_run, class_of)
        await session.warm_up()
        search = None
        search_doc = None
        if config.mode == "single":
            await session.run(config.request_rate)
        elif config.mode == "sweep":
            for rate in config.sweep_rates:
                await session.run(rate)
        else:
            search_settings = SearchSettings(
                config.slo_attainment, config.search_start_rate, config.search_tolerance, config.search_max_probes
            )

            async def probe(rate: float) -> float:
                return (await session.run(rate)).summary.attainment["all"]

            search = await find_max_rate(probe, search_settings)
            search_doc = search_json(search, search_settings, session.reports)
    config_json = {**config.as_json(), "model": model}
    return BenchResult(session.reports, search, document(config.mode, config_json, session.reports, search_doc))
