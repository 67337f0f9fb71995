"""The GPU runbook behind bench/gpu/run.sh: the environment once, then the chosen stages in the
order named, each recorded whatever happens to the others.

    bench/gpu/run.sh [STAGE... | all] [--dry-run] [--budget SECONDS] [--out-dir DIR]

No stage, or `all`: every stage in `stages.ORDER` (the NVSHMEM path first). A call on the device
may run 600 s: --budget (default 520 s, leaving the wheels' install, Python's start and the
archive a margin) bounds the whole run, and a stage starts only while its estimate fits in what
is left (its timeout is cut to what is left); the others are recorded as deferred and the summary
prints the command for the next call. Before anything runs the plan is printed: each stage in
order, its estimate, where in the budget it starts or that it is left to the next call, and the
total against the 600 s call.

Records: two files, whatever the stages (the device tool brings back at most 8): results.json
(the plan, env and every stage's record, rewritten after every stage, so a run cut short keeps
what it did) and logs.tar.gz (every log and the scripts' own outputs), in $OUT when OUT is set,
else in bench/results/gpu/. Without a CUDA device the run is a dry run (see dryrun.py): each
stage is skipped after its command lines were checked.
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

from stages import CALL_S, ENV, NEEDS_CUDA, ORDER, PEER_TIMEOUT_S, Pytest, Script, Stage, chosen, plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moeserve.dispatch.nvshmem import TIMEOUT_VAR  # noqa: E402

WHEELS = ROOT / ".whl"
DEFAULT_BUDGET_S = 520.0
LOG_TAIL_LINES = 15
MAX_FILES = 8  # what the device tool brings back from $OUT
# One test's limit where pytest-timeout is installed (the GPU image has it). Its thread method: the
# default (signals) cannot interrupt a thread blocked in a CUDA synchronisation; the thread method
# dumps every stack and ends the process, which costs that process's file only (Pytest.per_file).
PYTEST_TIMEOUT_S = 120


@dataclass(frozen=True)
class Layout:
    results: Path
    """results.json: the plan, env and every stage's record."""
    archive: Path
    """logs.tar.gz: the work folder."""
    work: Path
    """Scratch: a folder per stage with its log and its scripts' outputs."""


def layout(out_dir: Path | None, dry_run: bool) -> Layout:
    if out_dir is None and os.environ.get("OUT"):
        out_dir = Path(os.environ["OUT"])
    elif out_dir is None and dry_run:  # a dry run on a developer's machine leaves the repository alone
        out_dir = Path(tempfile.mkdtemp(prefix="moeserve-runbook-dry-"))
    elif out_dir is None:
        out_dir = ROOT / "bench" / "results" / "gpu"
    out_dir.mkdir(parents=True, exist_ok=True)
    return Layout(out_dir / "results.json", out_dir / "logs.tar.gz", Path(tempfile.mkdtemp(prefix="moeserve-runbook-")))


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
    """The command's targets, or every test file that uses the `gpu` marker but the excluded."""
    if command.targets:
        return list(command.targets)
    return sorted(
        name
        for p in (ROOT / "tests").rglob("test_*.py")
        if "pytest.mark.gpu" in p.read_text() and (name := str(p.relative_to(ROOT))) not in command.exclude
    )


def processes(stage: Stage) -> list[Script | Pytest]:
    """The stage's commands as the processes they run: a `per_file` pytest becomes one per file."""
    out: list[Script | Pytest] = []
    for command in stage.commands:
        if isinstance(command, Pytest) and command.per_file:
            out += [Pytest(command.marker, (target,)) for target in pytest_targets(command)]
        else:
            out.append(command)
    return out


def command_argv(command: Script | Pytest, work: Path) -> list[str]:
    if isinstance(command, Script):
        return [sys.executable, command.path, *command.args, "--out", str(work / command.result)]
    files = "-".join(Path(t.split("::", 1)[0]).stem for t in command.targets) if len(command.targets) == 1 else ""
    junit = work / f"junit-{'-'.join(filter(None, [command.marker.replace(' ', '-'), files]))}.xml"
    argv = [sys.executable, "-m", "pytest", "-v", "--tb=short", "-rfE", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        argv += [f"--timeout={PYTEST_TIMEOUT_S}", "--timeout-method=thread"]
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
    env = {**os.environ, TIMEOUT_VAR: str(PEER_TIMEOUT_S)}  # the kernels' waits end before any watchdog
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
    plan: list[dict] = field(default_factory=list)

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
            for command in processes(stage):
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
        self.save()
        return record

    def save(self) -> None:
        """results.json (replaced whole, so a kill mid-write leaves the last one) and logs.tar.gz."""
        text = json.dumps({"summary": self.summary(), "plan": self.plan, "stages": self.records}, indent=2)
        partial = self.layout.results.with_name(self.layout.results.name + ".partial")
        partial.write_text(text + "\n")
        os.replace(partial, self.layout.results)
        self.archive()

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
        partial = self.layout.archive.with_name(self.layout.archive.name + ".partial")
        with tarfile.open(partial, "w:gz") as tar:
            tar.add(self.layout.work, arcname="runbook")
        os.replace(partial, self.layout.archive)


def planned(stages: list[Stage], budget_s: float) -> list[dict]:
    """The call's plan as records: each stage in order with its estimate and start (or next call)."""
    return [
        {"stage": s.name, "expected_s": s.expected_s, "timeout_s": s.timeout_s, "starts_at_s": at}
        for s, at in plan(stages, budget_s)
    ]


def plan_lines(entries: list[dict], budget_s: float) -> list[str]:
    """The plan as printed: order, estimates, this call or the next, and the total against the call."""
    lines = [f"plan: budget {budget_s:.0f} s of the {CALL_S} s call; env {ENV.expected_s} s first, then in order:"]
    for i, e in enumerate(entries, 1):
        when = f"starts at ~{e['starts_at_s']:.0f} s" if e["starts_at_s"] is not None else "next call"
        lines.append(f"  {i}. {e['stage']:9s} ~{e['expected_s']:4d} s (limit {e['timeout_s']:3d} s)  {when}")
    now = ENV.expected_s + sum(e["expected_s"] for e in entries if e["starts_at_s"] is not None)
    later = [e["stage"] for e in entries if e["starts_at_s"] is None]
    lines.append(
        f"plan: this call ~{now} s of the {budget_s:.0f} s budget ({CALL_S - budget_s:.0f} s of the {CALL_S} s call "
        f"left for the wheels, start-up and archive); " + (f"next call: {' '.join(later)}" if later else "no next call")
    )
    return lines


def describe(record: dict) -> str:
    line = f"{record['stage']:9s} {record['status']:9s}"
    if "seconds" in record:
        line += f" {record['seconds']:6.1f} s"
    if record.get("reason"):
        line += f"  {record['reason']}"
    return line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/gpu/run.sh", description=__doc__.split("\n\n")[0])
    names = list(ORDER)
    parser.add_argument("stages", nargs="*", metavar="STAGE", help=f"in the order to run: all (default), or of {names}")
    parser.add_argument("--dry-run", action="store_true", help="check every command line; run nothing on a device")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole run; 0: none")
    parser.add_argument(
        "--out-dir", type=Path, help="results.json and logs.tar.gz here (default: $OUT, else bench/results/gpu)"
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.stages if name not in (*names, "all")]  # choices would refuse none at all
    if unknown:
        parser.error(f"unknown stage(s) {unknown}: choose from {names} or all")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(ROOT)
    import torch

    dry_run = args.dry_run
    if not dry_run and not torch.cuda.is_available():
        print("runbook: no CUDA device here: a dry run instead", flush=True)
        dry_run = True
    wanted = chosen(args.stages)
    book = Runbook(layout(args.out_dir, dry_run), dry_run, args.budget, plan=planned(wanted, args.budget))
    wheels = wheel_report(installed=not dry_run)
    # No torch.cuda call that makes a context here: this process would hold it through every stage.
    print(f"runbook: {'dry run' if dry_run else 'CUDA device present'}; stages {[s.name for s in wanted]}")
    print("\n".join(plan_lines(book.plan, args.budget)), flush=True)
    print(f"runbook: wheels in .whl/: missing {wheels['missing'] or 'none'}, unpinned {wheels['unpinned'] or 'none'}")
    if wheels.get("not_installed_at_pin"):
        print(f"runbook: WARNING: not importable at their pins: {wheels['not_installed_at_pin']}", flush=True)
    env = book.run(ENV)
    if dry_run and env["status"] != "failed":
        import gpu_env

        env["software"] = gpu_env.software()
    env["wheels"] = wheels
    book.save()  # the record, now with the software and the wheels
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
    book.save()
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
