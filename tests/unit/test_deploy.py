"""The deployment recipes call `moeserve launch` with flags that exist and mean what they say."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from moeserve.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ENV = {
    "LWS_GROUP_SIZE": "2",
    "LWS_WORKER_INDEX": "1",
    "LWS_LEADER_ADDRESS": "10.0.0.1",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "MODEL": "/models/m",
    "EP": "16",
    "TP": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}


def launch_commands(text: str) -> list[list[str]]:
    """Every `moeserve launch ...` command, shell continuations joined and variables filled in."""
    text = text.replace("\\\n", " ")
    commands = []
    for match in re.finditer(r"moeserve launch(?= --)((?:[^\n]|\n +(?=--))*)", text):
        args = re.sub(r"\\?\$\(?\{?(\w+)\)?\}?", lambda m: ENV.get(m.group(1), m.group(0)), match.group(1))
        commands.append(shlex.split(args.replace("'", "").replace('"', "")))
    return commands


@pytest.mark.parametrize("recipe,count", [("kubernetes/leaderworkerset.yaml", 2), ("slurm/moeserve.sbatch", 1)])
def test_recipes_use_real_flags(recipe: str, count: int) -> None:
    commands = launch_commands((DEPLOY / recipe).read_text())
    assert len(commands) == count, commands  # the LWS leader and worker; the one srun
    for argv in commands:
        args = build_parser().parse_args(["launch", *argv])  # exits (fails the test) on an unknown flag
        assert args.nnodes == 2 and args.node_rank == 1
        assert args.master_addr == "10.0.0.1" and args.master_port == 29500
        assert args.ep % args.nnodes == 0 and args.ep % args.tp == 0


ROOT = DEPLOY.parent
INSTALL = "deploy/docker/install.sh"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    return [tuple(line.split(None, 1)) for line in joined.splitlines() if line.strip()]


def test_dockerfile_installs_with_the_script_ci_runs() -> None:
    """The image and CI share one install recipe: the Dockerfile runs it (cuda), .ci/run runs it (cpu)."""
    runs = [args for instruction, args in dockerfile_instructions() if instruction == "RUN"]
    assert [run for run in runs if re.search(rf"/src/{INSTALL} --flavour cuda --prefix (\S+)", run)]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^\s*timed {INSTALL} --flavour cpu --prefix ", ci, re.M)
    assert re.search(r'^\s*timed "?\S+/bin/python"? deploy/docker/smoke\.py$', ci, re.M)


def test_image_runs_the_nvshmem_ci_compiles_the_kernels_against() -> None:
    """The put kernels link NVSHMEM's device bitcode, and NVSHMEM refuses device code of another
    version than its host library: the image must install the version CI checks them with."""
    image = re.search(r'^NVSHMEM_WHEEL="nvidia-nvshmem-cu\$CUDA_MAJOR==([\d.]+)"$', (ROOT / INSTALL).read_text(), re.M)
    ci = re.findall(r"--target \.nvshmem nvidia-nvshmem-cu\d+==([\d.]+)$", (ROOT / ".ci" / "run").read_text(), re.M)
    assert image and ci == [image.group(1)], (image, ci)


def test_dockerfile_copies_only_what_the_build_context_holds() -> None:
    """.dockerignore excludes all but what is re-included; a COPY of anything else fails the build."""
    patterns = (ROOT / ".dockerignore").read_text().splitlines()
    included = {line[1:].rstrip("/") for line in patterns if line.startswith("!")}
    copies = [args.split()[:-1] for instruction, args in dockerfile_instructions() if instruction == "COPY"]
    sources = [source for copy in copies for source in copy]
    assert INSTALL in sources
    for source in sources:
        assert (ROOT / source).exists(), source
        assert source in included, f"{source} is not in the build context (.dockerignore)"


def test_dockerfile_default_command_is_a_valid_launch() -> None:
    (cmd,) = [json.loads(args) for instruction, args in dockerfile_instructions() if instruction == "CMD"]
    assert cmd[:2] == ["moeserve", "launch"]
    args = build_parser().parse_args(cmd[1:])
    assert args.host == "0.0.0.0" and args.port == 8000  # reachable from outside the container, on EXPOSE's port


@pytest.mark.parametrize(
    "argv,error",
    [
        (["--prefix", "/nonexistent"], "--flavour cpu or cuda is required"),
        (["--flavour", "gpu", "--prefix", "/nonexistent"], "--flavour cpu or cuda is required"),
        (["--flavour", "cpu"], "--prefix VENV is required"),
        (["--flavour", "cpu", "--prefx", "/nonexistent"], "unknown argument --prefx"),
    ],
)
def test_install_script_refuses_bad_arguments_before_installing(argv: list[str], error: str) -> None:
    result = subprocess.run(["bash", str(ROOT / INSTALL), *argv], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and error in result.stderr, result.stderr
    assert not Path("/nonexistent").exists()


def test_disaggregated_recipe_uses_real_flags_and_roles() -> None:
    text = (DEPLOY / "kubernetes/disaggregated.yaml").read_text()
    prefill, decode = (build_parser().parse_args(["launch", *argv]) for argv in launch_commands(text))
    assert (prefill.role, prefill.kv_transfer, prefill.ep, prefill.kv_transfer_port) == ("prefill", "nixl", 2, 8100)
    assert (decode.role, decode.kv_transfer, decode.nnodes, decode.node_rank) == ("decode", "nixl", 2, 1)
    assert decode.ep % decode.nnodes == 0 and decode.tp == 1
    router_args = re.search(r"- router\n((?:\s+- .+\n)+)", text).group(1)
    argv = [line.strip()[2:].strip('"') for line in router_args.splitlines()]
    router = build_parser().parse_args(["router", *argv])
    assert len(router.prefill) == 2 and len(router.decode) == 1 and router.port == 8000
