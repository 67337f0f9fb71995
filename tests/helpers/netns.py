"""Separate hosts on one machine: Linux network namespaces on a bridge, each with its own
interface and address, as real machines have them (10.200.0.1, .2, ... on interface `eth0`).

Everything runs on loopback where a multi-node test runs on one network namespace, which hides
exactly what goes wrong between machines: an interface chosen by host name, a cut link. Each
host here is a namespace `<prefix>h<i>` with one end of a veth pair; the other ends sit on a
bridge in a namespace of its own (`<prefix>sw`, the switch), so cutting a host's link is taking
its switch port down, and the host sees its peers go silent. Names carry the test process's pid,
so concurrent runs never meet; `close` ends whatever runs in them and deletes them.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
_CLONE_NEWNET = 0x40000000
SUBNET = "10.200.0"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can): run as root on Linux with iproute2."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"msprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Hosts:
    """`count` hosts on one switch; host i has address `address(i)` on its interface `eth0`."""

    def __init__(self, count: int, tag: str) -> None:
        self.prefix = f"ms{os.getpid()}{tag}"
        self.switch = f"{self.prefix}sw"
        self.names = [f"{self.prefix}h{i}" for i in range(count)]
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for ns in (self.switch, *self.names):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"port{i}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    @staticmethod
    def address(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def cut(self, i: int) -> None:
        """Take host i's switch port down: its link goes dark, nothing is sent or refused."""
        _ip("-n", self.switch, "link", "set", f"port{i}", "down")

    def restore(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", f"port{i}", "up")

    def popen(self, i: int, argv: list[str], **kwargs: object) -> subprocess.Popen:
        """`argv` on host i (`ip netns exec` execs it: the pid is the command's own)."""
        return subprocess.Popen(["ip", "netns", "exec", self.names[i], *argv], **kwargs)  # type: ignore[call-overload]

    def call(self, i: int, fn: Callable[[], T]) -> T:
        """`fn()` from host i's network (a thread that entered it: a namespace is per thread)."""
        outcome: list = []

        def run() -> None:
            try:
                with open(f"/run/netns/{self.names[i]}") as handle:
                    if ctypes.CDLL(None, use_errno=True).setns(handle.fileno(), _CLONE_NEWNET):
                        raise OSError(ctypes.get_errno(), "setns failed")
                outcome.append((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
                outcome.append((False, exc))

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """End every process still in the hosts (SIGKILL, by pid), then delete the namespaces."""
        for ns in self._made:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5.0
        for ns in self._made:
            while time.monotonic() < deadline:
                if not subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.strip():
                    break
                time.sleep(0.05)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
