"""The GPU runbook behind bench/gpu/run.sh: the environment once, then the chosen stages, each
recorded whatever happens to the others.

    bench/gpu/run.sh STAGE... | all [--dry-run] [--budget SECONDS] [--out-dir DIR]

Records: `<stage>.json` per stage and `env.json` in $OUT/results/ when OUT is set (the device
tool brings back at most 8 files), else in bench/results/gpu/; every log, the scripts' own
outputs and summary.json in one logs.tar.gz beside them (rewritten after every stage, so a run
cut short keeps what it did). Stages are in stages.py.

A call on the device may run 10 minutes: --budget (default 560 s) bounds the whole run, and a
stage starts only while its expected length fits in what is left (its timeout is cut to what
is left); the others are recorded as deferred and the summary prints the command for the next
call. Without a CUDA device the run is
a dry run (see dryrun.py): each stage is skipped after its command lines were checked.
Exit status: 1 if a stage failed (a dry run: if a check failed), else 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stages import ENV, NEEDS_CUDA, STAGES, Pytest, Script, Stage  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".whl"
DEFAULT_BUDGET_S = 560.0
LOG_TAIL_LINES = 15
PYTEST_TIMEOUT_S = 150  # one test's limit, where pytest-timeout is installed


@dataclass(frozen=True)
class Layout:
    results: Path
    """Where env.json and each <stage>.json go."""
    archive: Path
    """logs.tar.gz: the work folder and summary.json."""
    work: Path
    """Scratch: a folder per stage with its log and its scripts' outputs."""


def layout(out_dir: Path | None, dry_run: bool) -> Layout:
    if out_dir is not None:
        results = out_dir
    elif os.environ.get("OUT"):
        results = Path(os.environ["OUT"]) / "results"
    elif dry_run:  # a dry run on a developer's machine leaves the repository alone
        results = Path(tempfile.mkdtemp(prefix="moeserve-runbook-dry-"))
    else:
        results = ROOT / "bench" / "results" / "gpu"
    archive = (results.parent if os.environ.get("OUT") and out_dir is None else results) / "logs.tar.gz"
    results.mkdir(parents=True, exist_ok=True)
    return Layout(results, archive, Path(tempfile.mkdtemp(prefix="moeserve-runbook-")))


def pinned() -> dict[str, str]:
    """wheels.txt as {normalised name: version}."""
    lines = (line.split("#", 1)[0].strip() for line in (ROOT / "bench/gpu/wheels.txt").read_text().splitlines())
    pairs = (line.split("==", 1) for line in lines if line)
    return {name.lower().replace("_", "-"): version for name, version in pairs}


def wheel_report(installed: bool) -> dict:
    """Which pinned wheels .whl/ holds (and, on the device, which are importable at their pin)."""
    present = {}
    for wheel in sorted(WHEELS.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        present[name.lower().replace("_", "-")] = version
    pins = pinned()
    report = {
        "missing": sorted(f"{n}=={v}" for n, v in pins.items() if present.get(n) != v),
        "unpinned": sorted(f"{n}=={v}" for n, v in present.items() if pins.get(n) != v),
    }
    if installed:
        import importlib.metadata

        wrong = {}
        for name, version in pins.items():
            try:
                found = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                found = None
            if found != version:
                wrong[name] = found
        report["not_installed_at_pin"] = wrong
    return report


def pytest_targets(command: Pytest) -> list[str]:
    """The command's targets, or every test file that uses the `gpu` marker."""
    if command.targets:
        return list(command.targets)
    return sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "pytest.mark.gpu" in p.read_text()
    )


def command_argv(command: Script | Pytest, work: Path) -> list[str]:
    if isinstance(command, Script):
        return [sys.executable, command.path, *command.args, "--out", str(work / command.result)]
    junit = work / f"junit-{command.marker.replace(' ', '-')}.xml"
    argv = [sys.executable, "-m", "pytest", "-v", "--tb=short", "-rfE", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("pytest_timeout") is not None:  # in the GPU image: a hung kernel costs 150 s
        argv.append(f"--timeout={PYTEST_TIMEOUT_S}")
    return [*argv, "-m", command.marker, "--junitxml", str(junit), *pytest_targets(command)]


def junit_summary(path: Path) -> dict | None:
    """Counts and the failing tests (with the first line of why) from a pytest junit file."""
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    failed = []
    for case in suite.iter("testcase"):
        problem = case.find("failure")
        problem = problem if problem is not None else case.find("error")
        if problem is not None:
            message = (problem.get("message") or "").strip().splitlines()
            failed.append(f"{case.get('classname')}::{case.get('name')}: {message[0][:300] if message else ''}")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed}


def execute(argv: list[str], log: io.TextIOBase, timeout_s: float) -> tuple[int | None, float]:
    """Run `argv` in its own process group, output to `log`; (exit code or None if killed at the timeout, seconds)."""
    started = time.monotonic()
    log.write(f"\n$ {' '.join(argv)}\n")
    log.flush()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code: int | None = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the stage's servers and rank processes too
        proc.wait()
        code = None
    return code, time.monotonic() - started


@dataclass
class Runbook:
    layout: Layout
    dry_run: bool
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    records: dict[str, dict] = field(default_factory=dict)

    def left(self) -> float:
        return float("inf") if self.budget_s <= 0 else self.budget_s - (time.monotonic() - self.started)

    def run(self, stage: Stage) -> dict:
        record = {"stage": stage.name, "proves": stage.proves, "commands": []}
        work = self.layout.work / stage.name
        work.mkdir()
        if not self.dry_run and self.left() < stage.expected_s:
            record |= {
                "status": "deferred",
                "reason": f"expected to take {stage.expected_s} s; {max(self.left(), 0):.0f} s of the budget left",
            }
            return self._save(stage, record)
        started = time.monotonic()
        with open(work / "log.txt", "w") as log:
            for command in stage.commands:
                if self.dry_run:
                    record["commands"].append(self._dry(command, work, log))
                else:
                    record["commands"].append(self._real(command, work, log, started, stage))
        record["seconds"] = round(time.monotonic() - started, 1)
        statuses = [c["status"] for c in record["commands"]]
        if "failed" in statuses:
            record["status"] = "failed"
            record["reason"] = "; ".join(c["reason"] for c in record["commands"] if c["status"] == "failed")
        elif "deferred" in statuses:
            record["status"] = "deferred"
            record["reason"] = "; ".join(c["reason"] for c in record["commands"] if c["status"] == "deferred")
        elif all(s == "skipped" for s in statuses):
            record["status"] = "skipped"
            record["reason"] = (
                "dry run: no CUDA device here; its command lines were checked"
                if self.dry_run
                else "; ".join(c["reason"] for c in record["commands"])
            )
        else:
            record["status"] = "passed"
        if record["status"] == "failed" and not self.dry_run:
            lines = (work / "log.txt").read_text(errors="replace").splitlines()
            record["log_tail"] = lines[-LOG_TAIL_LINES:]
        return self._save(stage, record)

    def _dry(self, command: Script | Pytest, work: Path, log: io.TextIOBase) -> dict:
        import dryrun

        argv = command_argv(command, work)
        entry = {"argv": [Path(a).name if a == sys.executable else a for a in argv]}
        try:
            if isinstance(command, Script):
                detail = dryrun.check_script(command, argv[2:])
            else:
                detail = dryrun.check_pytest(command, argv[3:], pytest_targets(command), log)
        except dryrun.CheckFailed as e:
            return entry | {"status": "failed", "reason": str(e)}
        log.write(detail + "\n")
        return entry | {"status": "skipped", "checked": detail}

    def _real(self, command: Script | Pytest, work: Path, log: io.TextIOBase, started: float, stage: Stage) -> dict:
        argv = command_argv(command, work)
        stage_left = stage.timeout_s - (time.monotonic() - started)
        budget_cut = self.left() < stage_left  # the call ends first: what is cut runs again in the next
        timeout = min(stage_left, self.left())
        entry: dict = {"argv": [Path(a).name if a == sys.executable else a for a in argv]}
        name = command.path if isinstance(command, Script) else f"pytest -m {command.marker!r}"
        if timeout <= 1:
            status = "deferred" if budget_cut else "failed"
            return entry | {"status": status, "reason": f"{name}: no time left to start it"}
        code, seconds = execute(argv, log, timeout)
        entry |= {"exit_code": code, "seconds": round(seconds, 1)}
        if isinstance(command, Script):
            out = work / command.result
            try:  # written as the script goes; one killed while writing leaves it torn
                entry["result"] = json.loads(out.read_text()) if out.exists() else None
            except json.JSONDecodeError:
                entry["result"] = None
        else:
            entry["result"] = junit_summary(Path(argv[argv.index("--junitxml") + 1]))
        if code is None and budget_cut:
            return entry | {"status": "deferred", "reason": f"{name}: cut after {timeout:.0f} s, the call's budget"}
        if code is None:
            return entry | {"status": "failed", "reason": f"{name}: killed at its {timeout:.0f} s limit"}
        if code == 0 and isinstance(command, Pytest) and entry["result"] and not entry["result"]["passed"]:
            return entry | {"status": "failed", "reason": f"{name}: not one test ran (all skipped: no CUDA seen?)"}
        if code == 0:
            return entry | {"status": "passed"}
        if code == NEEDS_CUDA and isinstance(command, Script):
            return entry | {"status": "skipped", "reason": f"{name}: found no CUDA device"}
        return entry | {"status": "failed", "reason": f"{name}: exit status {code}"}

    def _save(self, stage: Stage, record: dict) -> dict:
        self.records[stage.name] = record
        (self.layout.results / f"{stage.name}.json").write_text(json.dumps(record, indent=2) + "\n")
        self.archive()
        return record

    def summary(self) -> dict:
        deferred = [name for name, r in self.records.items() if r["status"] == "deferred"]
        return {
            "dry_run": self.dry_run,
            "budget_s": self.budget_s,
            "seconds": round(time.monotonic() - self.started, 1),
            "stages": {name: r["status"] for name, r in self.records.items()},
            "next_call": f"bench/gpu/run.sh {' '.join(deferred)}" if deferred else None,
        }

    def archive(self) -> None:
        (self.layout.work / "summary.json").write_text(json.dumps(self.summary(), indent=2) + "\n")
        with tarfile.open(self.layout.archive, "w:gz") as tar:
            tar.add(self.layout.work, arcname="runbook")


def describe(record: dict) -> str:
    line = f"{record['stage']:9s} {record['status']:9s}"
    if "seconds" in record:
        line += f" {record['seconds']:6.1f} s"
    if record.get("reason"):
        line += f"  {record['reason']}"
    return line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/gpu/run.sh", description=__doc__.split("\n\n")[0])
    names = [s.name for s in STAGES]
    parser.add_argument("stages", nargs="+", choices=[*names, "all"], metavar="STAGE", help=f"all, or of {names}")
    parser.add_argument("--dry-run", action="store_true", help="check every command line; run nothing on a device")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole run; 0: none")
    parser.add_argument("--out-dir", type=Path, help="records here (default: $OUT/results, else bench/results/gpu)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(ROOT)
    import torch

    dry_run = args.dry_run
    if not dry_run and not torch.cuda.is_available():
        print("runbook: no CUDA device here: a dry run instead", flush=True)
        dry_run = True
    wanted = [s for s in STAGES if "all" in args.stages or s.name in args.stages]
    book = Runbook(layout(args.out_dir, dry_run), dry_run, args.budget)
    wheels = wheel_report(installed=not dry_run)
    # No torch.cuda call that makes a context here: this process would hold it through every stage.
    print(f"runbook: {'dry run' if dry_run else 'CUDA device present'}; stages {[s.name for s in wanted]}")
    print(f"runbook: wheels in .whl/: missing {wheels['missing'] or 'none'}, unpinned {wheels['unpinned'] or 'none'}")
    if wheels.get("not_installed_at_pin"):
        print(f"runbook: WARNING: not importable at their pins: {wheels['not_installed_at_pin']}", flush=True)
    env = book.run(ENV)
    if dry_run and env["status"] != "failed":
        import gpu_env

        env["software"] = gpu_env.software()
    env["wheels"] = wheels
    (book.layout.results / "env.json").write_text(json.dumps(env, indent=2) + "\n")
    print(describe(env), flush=True)
    measured = (env["commands"][0].get("result") or {}) if env["commands"] else {}
    if "ceilings" in measured:
        d, c = measured["device"], measured["ceilings"]
        print(
            f"env: {d['name']} ({d['sm_count']} SMs, driver {d['driver']}), torch {measured['software']['torch']}, "
            f"triton {measured['software']['triton']}, NVSHMEM {measured['software']['nvshmem_packages']}; "
            f"copy {c['copy_gbps']:.0f} GB/s, bf16 GEMM {c['gemm_bf16_tflops']:.0f} TFLOP/s",
            flush=True,
        )
    for stage in wanted:
        print(f"--- {stage.name}: {stage.proves}", flush=True)
        record = book.run(stage)
        print(describe(record), flush=True)
        for line in record.get("log_tail", []):
            print(f"    | {line}")
    book.archive()
    shutil.rmtree(book.layout.work)  # all of it is in the archive
    summary = book.summary()
    print("\nsummary:")
    for name in summary["stages"]:
        print("  " + describe(book.records[name]))
    if summary["next_call"]:
        print(f"next call: {summary['next_call']}")
    print(f"records in {book.layout.results}, logs in {book.layout.archive}")
    return 1 if "failed" in summary["stages"].values() else 0


if __name__ == "__main__":
    sys.exit(main())
