"""The GPU runbook (bench/gpu/run.sh) on a CPU machine: its dry run checks every stage's command
line and exits 0, a bad command line fails it, its recording of real runs (exit codes, timeouts,
the call's budget) works with stand-in scripts, and the carried wheels cover what the stages import
beyond the GPU image's packages."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu"
STAGE_NAMES = ("puts", "tests", "parity", "serve", "dispatch", "kernels", "decode")


@pytest.fixture(scope="module")
def runbook():
    spec = importlib.util.spec_from_file_location("gpu_runbook_under_test", GPU / "runbook.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_dry_run_walks_every_stage(tmp_path):
    """`run.sh` with no stage: the default call, planned and checked; two files come back."""
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    proc = subprocess.run([str(GPU / "run.sh"), "--dry-run"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "plan: budget 520 s of the 600 s call; env 20 s first, then in order:" in proc.stdout
    assert re.search(r"  1\. puts +~ *\d+ s \(limit 240 s\)  starts at ~20 s", proc.stdout), proc.stdout
    summary = proc.stdout[proc.stdout.index("summary:") :]
    for name in ("env", *STAGE_NAMES):
        assert f"  {name:9s} skipped" in summary
    # What the device tool brings back: at most 8 files, at most 2 folders down.
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["logs.tar.gz", "results.json"]
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["stages"]) == ["env", *STAGE_NAMES]  # puts first: the order run.sh gives
    assert [e["stage"] for e in results["plan"]] == list(STAGE_NAMES)
    for name in STAGE_NAMES:
        record = results["stages"][name]
        assert record["status"] == "skipped" and record["commands"]
        assert all(c["status"] == "skipped" and c["checked"] for c in record["commands"])
    puts, tests = results["stages"]["puts"], results["stages"]["tests"]
    assert puts["commands"][0]["argv"][1] == "bench/dispatch_puts.py"
    assert "tests/unit/test_nvshmem_steps_and_refusals.py" in puts["commands"][1]["argv"]
    argvs = [c["argv"] for c in tests["commands"]]
    assert not any("bench/gpu/compile_check.py" in a for a in argvs)  # CI compiles; the device tests
    # One process per file, the NVSHMEM path's own tests left to the puts stage.
    assert sum("tests/kernels/test_fused_moe.py" in a for a in argvs) == 1 and len(argvs) > 10
    assert not any("tests/unit/test_nvshmem_steps_and_refusals.py" in a for a in argvs)
    assert re.fullmatch(r"pytest -m 'gpu': \d+ tests in 1 files collect", tests["commands"][0]["checked"])
    env_record = results["stages"]["env"]
    assert env_record["software"]["python"] and "missing" in env_record["wheels"]
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert "runbook/tests/log.txt" in tar.getnames()
    assert results["summary"]["dry_run"] and set(results["summary"]["stages"]) == {"env", *STAGE_NAMES}


def test_stages_run_in_the_order_named_and_the_default_call_fits(runbook):
    """The order given is the order run; `all` (or nothing) is the NVSHMEM path first; the plan
    the runbook follows fits the budget, and the budget the 600 s call with a margin."""
    stages = sys.modules["stages"]
    assert [s.name for s in stages.chosen(["tests", "puts"])] == ["tests", "puts"]
    assert [s.name for s in stages.chosen([])] == [s.name for s in stages.chosen(["all"])] == list(STAGE_NAMES)
    assert [s.name for s in stages.chosen(["decode", "all"])] == ["decode", *STAGE_NAMES[:-1]]
    with pytest.raises(SystemExit):
        runbook.parse_args(["puts", "nonsense"])
    budget = runbook.DEFAULT_BUDGET_S
    assert budget + 60 <= stages.CALL_S  # the wheels' install, Python's start and the archive
    plan = runbook.planned(stages.chosen([]), budget)
    now = [e for e in plan if e["starts_at_s"] is not None]
    assert [e["stage"] for e in now][:2] == ["puts", "tests"]
    assert stages.ENV.expected_s + sum(e["expected_s"] for e in now) <= budget
    for e in now:  # each starts where the one before it is expected to end
        assert e["starts_at_s"] + e["expected_s"] <= budget
    assert any(e["starts_at_s"] is None for e in plan)  # every stage together does not fit one call
    # A stage that does not fit leaves its room to a later, shorter one.
    long, short = (stages.Stage(n, "", (), 10, s) for n, s in (("long", 400), ("short", 50)))
    got = stages.plan([long, long, short], 500)
    assert [at for _, at in got] == [stages.ENV.expected_s, None, stages.ENV.expected_s + 400]
    lines = runbook.plan_lines(runbook.planned([long, short], 500), 500)
    assert lines[-1].startswith(f"plan: this call ~{stages.ENV.expected_s + 450} s of the 500 s budget")
    # One results.json and one archive, whatever the stages: never more than the device brings back.
    assert 2 <= runbook.MAX_FILES


def test_the_kernels_time_out_before_any_watchdog(runbook, monkeypatch):
    """A hang must be reported by the kernels (PeerTimeout, phase and peer), not a watchdog's kill:
    their wait bound, which the runbook sets for every stage, is below each stage's limit, each
    script's own watchdog and pytest's per-test limit."""
    from moeserve.dispatch import nvshmem

    stages = sys.modules["stages"]
    peer = stages.PEER_TIMEOUT_S
    assert peer < runbook.PYTEST_TIMEOUT_S
    for stage in stages.STAGES:
        assert peer < stage.timeout_s
        for command in stage.commands:
            args = command.args if isinstance(command, stages.Script) else ()
            for flag in ("--world-timeout", "--stall-limit", "--time-limit"):
                if flag in args:
                    assert peer < float(args[args.index(flag) + 1]), (stage.name, flag)
    monkeypatch.delenv(nvshmem.TIMEOUT_VAR, raising=False)
    assert nvshmem.default_timeout_s() == nvshmem.WAIT_TIMEOUT_S
    monkeypatch.setenv(runbook.TIMEOUT_VAR, str(peer))
    assert nvshmem.default_timeout_s() == peer


def test_pytest_runs_under_the_thread_timeout_method(runbook, monkeypatch, tmp_path):
    """Where pytest-timeout is installed (the GPU image), each test is bounded by its thread method:
    the signal method cannot interrupt a thread blocked in a CUDA synchronisation."""
    stages = sys.modules["stages"]
    found = runbook.importlib.util.find_spec
    monkeypatch.setattr(
        runbook.importlib.util, "find_spec", lambda name: object() if name == "pytest_timeout" else found(name)
    )
    argv = runbook.command_argv(stages.Pytest("gpu", ("tests/kernels/test_norm.py",)), tmp_path)
    assert f"--timeout={runbook.PYTEST_TIMEOUT_S}" in argv and "--timeout-method=thread" in argv
    assert argv[argv.index("--junitxml") + 1].endswith("junit-gpu-test_norm.xml")


def test_dry_run_fails_a_bad_command_line(runbook, tmp_path):
    stages = sys.modules["stages"]
    (tmp_path / "work").mkdir()
    book = runbook.Runbook(
        runbook.Layout(tmp_path / "results.json", tmp_path / "logs.tar.gz", tmp_path / "work"), dry_run=True, budget_s=0
    )
    bad = stages.Stage(
        "bad",
        "nothing",
        (
            stages.Script("bench/moe_kernel.py", ("--tokens", "many"), "r.json"),
            stages.Pytest("gpu", ("tests/kernels/test_no_such_file.py",)),
        ),
        60,
        1,
    )
    record = book.run(bad)
    assert record["status"] == "failed"
    assert "invalid int value: 'many'" in record["commands"][0]["reason"]
    assert "pytest targets missing: tests/kernels/test_no_such_file.py" in record["commands"][1]["reason"]


def _script(tmp_path: Path, name: str, body: str) -> str:
    """A stand-in stage script taking --out, as the real ones do."""
    path = tmp_path / f"{name}.py"
    path.write_text("import json, sys, time\nout = sys.argv[sys.argv.index('--out') + 1]\n" + textwrap.dedent(body))
    return str(path)


def test_real_runs_are_recorded_and_bounded(runbook, tmp_path):
    stages = sys.modules["stages"]
    results = tmp_path / "results"
    results.mkdir()
    (tmp_path / "work").mkdir()
    book = runbook.Runbook(
        runbook.Layout(results / "results.json", tmp_path / "logs.tar.gz", tmp_path / "work"),
        dry_run=False,
        budget_s=300,
    )
    ok = _script(tmp_path, "ok", "json.dump({'x': 1}, open(out, 'w'))\n")
    no_cuda = _script(tmp_path, "no_cuda", "print('needs CUDA'); sys.exit(2)\n")
    broken = _script(tmp_path, "broken", "print('boom'); sys.exit(1)\n")
    slow = _script(tmp_path, "slow", "time.sleep(60)\n")
    mixed = stages.Stage(
        "mixed",
        "",
        (stages.Script(ok, (), "ok.json"), stages.Script(no_cuda, (), "n.json"), stages.Script(broken, (), "b.json")),
        20,
        1,
    )
    record = book.run(mixed)
    assert [c["status"] for c in record["commands"]] == ["passed", "skipped", "failed"]
    assert record["commands"][0]["result"] == {"x": 1}
    assert record["status"] == "failed" and "broken.py: exit status 1" in record["reason"]
    assert "boom" in "\n".join(record["log_tail"])
    assert book.run(stages.Stage("fine", "", (stages.Script(ok, (), "ok.json"),), 20, 1))["status"] == "passed"
    unrun = book.run(stages.Stage("unrun", "", (stages.Script(no_cuda, (), "n.json"),), 20, 1))
    assert unrun["status"] == "skipped" and unrun["reason"].endswith("no_cuda.py: found no CUDA device")
    timed = book.run(stages.Stage("timed", "", (stages.Script(slow, (), "s.json"),), 2, 1))
    assert timed["status"] == "failed" and "killed at its 2 s limit" in timed["reason"]
    skipped = book.run(stages.Stage("skips", "", (stages.Pytest("gpu", ("tests/kernels/test_norm.py",)),), 150, 1))
    assert skipped["commands"][0]["result"]["skipped"] == skipped["commands"][0]["result"]["tests"] > 0
    assert skipped["status"] == "failed" and "not one test ran" in skipped["reason"]  # no CUDA here
    late = book.run(stages.Stage("late", "", (stages.Script(ok, (), "ok.json"),), 30, 600))
    assert late["status"] == "deferred" and not late["commands"]
    book.budget_s = (time.monotonic() - book.started) + 3  # 3 s left: the next stage starts, and is cut
    cut = book.run(stages.Stage("cut", "", (stages.Script(slow, (), "s.json"), stages.Script(ok, (), "o.json")), 60, 1))
    assert cut["status"] == "deferred" and re.search(r"slow.py: cut after [23] s, the call.s budget", cut["reason"])
    assert [c["status"] for c in cut["commands"]] == ["deferred", "deferred"]
    assert book.summary()["next_call"] == "bench/gpu/run.sh late cut"
    assert json.loads((results / "results.json").read_text())["stages"]["mixed"]["status"] == "failed"


def test_junit_summary(runbook, tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="1" skipped="1">'
        '<testcase classname="a" name="t1"/><testcase classname="a" name="t2"><failure message="bad&#10;more"/>'
        '</testcase><testcase classname="b" name="t3"><error message="oops"/></testcase>'
        '<testcase classname="b" name="t4"><skipped/></testcase></testsuite></testsuites>'
    )
    got = runbook.junit_summary(junit)
    assert got == {
        "tests": 4,
        "failures": 1,
        "errors": 1,
        "skipped": 1,
        "passed": 1,
        "failed": ["a::t2: bad", "b::t3: oops"],
    }


# --- the carried wheels ---------------------------------------------------------------------------


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _names(path: Path) -> set[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {_normal(line.split("==", 1)[0]) for line in lines if line}


def _stage_files(runbook) -> list[Path]:
    """Every Python file a stage runs or imports from this repository."""
    stages = sys.modules["stages"]
    files = {*ROOT.joinpath("moeserve").rglob("*.py"), *GPU.glob("*.py"), *ROOT.joinpath("tests/helpers").glob("*.py")}
    files |= {ROOT / "tests/conftest.py", ROOT / "tests/kernels/conftest.py"}
    for stage in (stages.ENV, *stages.STAGES):
        for command in stage.commands:
            if isinstance(command, stages.Script):
                files.add(ROOT / command.path)
            else:
                files |= {ROOT / t for t in runbook.pytest_targets(command)}
    files |= {p for p in ROOT.joinpath("bench").glob("*.py") if p.stem in {"dispatch_check", "dispatch_timing"}}
    return sorted(files)


# Imported only where `nvshmem4py_heap.choose_nvshmem_host` found nvshmem4py importable (its
# `cuda.core` with it): without it the nvshmem all-to-all starts NVSHMEM through torch, so a stage
# never imports them on an image that lacks them. NIXL (`nixl_cu12`) is imported only when a
# disaggregated instance makes its KV agent (`--kv-transfer nixl`), which no stage does.
OPTIONAL_IMPORTS = {"nvshmem", "cuda", "nixl_cu12"}


def test_wheels_cover_every_stage_import(runbook):
    local = {p.stem for d in (ROOT, ROOT / "bench", GPU) for p in d.iterdir()}
    local |= {p.stem for p in ROOT.joinpath("tests").rglob("*.py")}  # test helpers beside their tests
    local |= {p.name for p in ROOT.joinpath("tests").iterdir() if p.is_dir()} | OPTIONAL_IMPORTS
    imported: dict[str, Path] = {}
    for path in _stage_files(runbook):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local:
                    imported.setdefault(top, path)
    providers = importlib.metadata.packages_distributions()
    available = _names(GPU / "image_packages.txt") | _names(GPU / "wheels.txt")
    uncovered = {
        top: str(path.relative_to(ROOT))
        for top, path in imported.items()
        if not any(_normal(d) in available for d in providers.get(top, [top]))
    }
    assert not uncovered, f"imported by a stage, neither in the GPU image nor in bench/gpu/wheels.txt: {uncovered}"
    assert {"zmq", "fastapi", "uvicorn", "pydantic"} <= set(imported)  # the scan sees the server's imports


def test_wheels_bring_their_own_requirements():
    """--no-deps installs: whatever a pinned wheel needs on the device must be pinned or in the image
    (read from this machine's metadata of each package installed here at its pin)."""
    from packaging.requirements import Requirement

    pins = dict(
        line.split("#", 1)[0].strip().split("==")
        for line in (GPU / "wheels.txt").read_text().splitlines()
        if line.split("#", 1)[0].strip()
    )
    available = _names(GPU / "image_packages.txt") | {_normal(n) for n in pins}
    device = {"python_version": "3.12", "sys_platform": "linux", "platform_machine": "x86_64", "extra": ""}
    device |= {"implementation_name": "cpython", "platform_system": "Linux", "os_name": "posix"}
    checked, missing = 0, {}
    for name, version in pins.items():
        try:
            if importlib.metadata.version(name) != version:
                continue
        except importlib.metadata.PackageNotFoundError:
            continue
        checked += 1
        for text in importlib.metadata.requires(name) or []:
            req = Requirement(text)
            if (req.marker is None or req.marker.evaluate(device)) and _normal(req.name) not in available:
                missing.setdefault(name, []).append(text)
    assert checked, f"none of the pins is installed here at its version ({sysconfig.get_platform()})"
    assert not missing, f"requirements of carried wheels that nothing provides on the device: {missing}"
