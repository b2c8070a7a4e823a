"""The fault test's network: every node in a network namespace of its own, links that can be cut,
healed and slowed, and nothing that can reach beyond the test's own namespaces.

Theory of operation. One ``Network`` belongs to one run and names everything it makes with a prefix
that carries the run's pid (``mnp<pid>``), so that what a killed run left behind is found and removed
by the next one (``remove_leftovers``: every name whose pid is no longer alive).

* A bridge ``<prefix>br`` in the test's (root) namespace with the address ``10.A.B.1/24``, where
  ``10.A.B.0/24`` is a /24 that no interface of the host uses. The test's clients (threads of the
  test process) reach every node through it, and are never cut: a client's view of a partition is
  the view of the node it is attached to.
* Per node a namespace ``<prefix>-<node>`` holding ``lo`` and ``eth0`` (a veth whose other end
  ``<prefix>v<i>`` is a port of the bridge) with the address ``10.A.B.<i + 2>/24``; the node binds
  and advertises that address. No namespace has a default route or any route beyond the /24, and
  nothing forwards or translates, so no packet can leave.
* A cut of the link from X to Y is a blackhole route to Y's address in X's namespace: X's packets to
  Y are dropped (a new connection fails at once, an open one retransmits into the void), while Y's
  packets still reach X. Both directions cut is a partition of the two. Healing deletes the route.
* A slow link (the kernel here has no netem) is a user-space proxy (``tests.fault.slow_link``) in the
  sending node's namespace: policy routing delivers X's TCP connections to Y's port locally
  (``ip rule ... to Y ipproto tcp dport P lookup 100``; table 100: ``local Y``), the proxy accepts
  them transparently (``IP_TRANSPARENT``: it answers as Y), holds every chunk for the delay and
  forwards it over its own connection to Y, which is marked (``SO_MARK``) so that it skips the rule.
  ``accept_local`` lets Y's replies, whose source is now also a local address, in. Open connections
  are reset when the rule appears or goes (the node reconnects), which a real route change does too.

Everything here is driven through iproute2 (``ip``) and needs root; ``unavailable()`` says why a
run cannot have namespaces, so that a test skips with that reason instead of passing silently.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX_BASE = "mnp"
IP_TIMEOUT_S = 10
SLOW_LINK_TABLE = 100  # the policy routing table of slow links, in a node's own namespace
SLOW_LINK_MARK = 1  # the proxies' own connections carry it and skip the rule
PROXY_READY_TIMEOUT_S = 10
REPO = Path(__file__).resolve().parent.parent.parent


class NetworkUnavailable(Exception):
    """Namespaces cannot be made here (not root, no iproute2, no kernel support)."""


def ip(*arguments: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *arguments], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(arguments)}: {result.stderr.strip() or result.returncode}")
    return result


def unavailable() -> str | None:
    """Why this process cannot build a ``Network`` (None: it can): tried for real, then undone."""
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed (apt-get install -y iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root (the partition test runs as root in CI)"
    probe = f"{PREFIX_BASE}{os.getpid()}-probe"
    try:
        result = ip("netns", "add", probe, check=False)
        if result.returncode != 0:
            return f"'ip netns add' failed: {result.stderr.strip()}"
    finally:
        ip("netns", "delete", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Remove namespaces and links of runs whose process is gone (killed runs); return their names."""
    removed = []
    pattern = re.compile(rf"^{PREFIX_BASE}(\d+)")
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = pattern.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _kill_namespace_processes(name)
            ip("netns", "delete", name, check=False)
            removed.append(name)
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        match = pattern.match(name)
        if match and not _pid_alive(int(match.group(1))):
            ip("link", "delete", name, check=False)
            removed.append(name)
    return removed


def _kill_namespace_processes(namespace: str) -> None:
    for pid in ip("netns", "pids", namespace, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _free_subnet(pid: int) -> ipaddress.IPv4Network:
    """A /24 in 10.100.0.0-10.249.255.0 that no address or route of the host overlaps, seeded by pid."""
    used = []
    for command in (("-4", "-o", "addr", "show"), ("-4", "route", "show", "table", "all")):
        for token in ip(*command, check=False).stdout.split():
            try:
                used.append(ipaddress.IPv4Network(token, strict=False))
            except ValueError:
                continue
    for attempt in range(150 * 256):
        index = (pid + attempt * 7919) % (150 * 256)
        subnet = ipaddress.IPv4Network(f"10.{100 + index // 256}.{index % 256}.0/24")
        if not any(subnet.overlaps(other) for other in used if other.prefixlen > 0):
            return subnet
    raise NetworkUnavailable("no free /24 in 10.100.0.0/16-10.249.0.0/16")


@dataclass
class SlowLink:
    sender: str
    receiver: str
    port: int
    delay_ms: int
    proxy: subprocess.Popen


@dataclass
class Network:
    """The namespaces, bridge and links of one run (``create``), removed by ``close`` (idempotent)."""

    nodes: list[str]
    log_dir: Path
    prefix: str = ""
    subnet: ipaddress.IPv4Network | None = None
    addresses: dict[str, str] = field(default_factory=dict)
    cuts: set[tuple[str, str]] = field(default_factory=set)
    slow_links: list[SlowLink] = field(default_factory=list)
    _created: list[tuple[str, str]] = field(default_factory=list)  # ("netns" | "link", name)

    @classmethod
    def create(cls, nodes: list[str], log_dir: Path) -> Network:
        """Build the namespaces of ``nodes`` (raise ``NetworkUnavailable`` with the reason if impossible)."""
        reason = unavailable()
        if reason is not None:
            raise NetworkUnavailable(reason)
        remove_leftovers()
        network = cls(list(nodes), log_dir, prefix=f"{PREFIX_BASE}{os.getpid()}")
        if len(network.nodes) > 250:
            raise ValueError("at most 250 nodes in one /24")
        try:
            network._build()
        except BaseException:
            network.close()
            raise
        return network

    # -- placement (tests.conftest.Cluster) --------------------------------------------------------

    def host(self, name: str) -> str:
        return self.addresses[name]

    def command_prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(name)]

    def namespace(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    # -- building and removing ---------------------------------------------------------------------

    def _build(self) -> None:
        self.subnet = _free_subnet(os.getpid())
        hosts = list(self.subnet.hosts())
        bridge = f"{self.prefix}br"
        ip("link", "add", bridge, "type", "bridge")
        self._created.append(("link", bridge))
        ip("addr", "add", f"{hosts[0]}/{self.subnet.prefixlen}", "dev", bridge)
        ip("link", "set", bridge, "up")
        for index, name in enumerate(self.nodes):
            namespace = self.namespace(name)
            ip("netns", "add", namespace)
            self._created.append(("netns", namespace))
            veth = f"{self.prefix}v{index}"
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            self._created.append(("link", veth))
            ip("link", "set", veth, "master", bridge, "up")
            address = str(hosts[index + 1])
            self.addresses[name] = address
            ip("-n", namespace, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
            ip("-n", namespace, "link", "set", "lo", "up")
            ip("-n", namespace, "link", "set", "eth0", "up")
            # For slow links: replies from an address that is also local (the proxy answers as the peer).
            for device in ("all", "eth0"):
                self._sysctl(namespace, f"net.ipv4.conf.{device}.accept_local", "1")
            ip("-n", namespace, "rule", "add", "fwmark", str(SLOW_LINK_MARK), "lookup", "main", "pref", "100")

    def _sysctl(self, namespace: str, key: str, value: str) -> None:
        path = "/proc/sys/" + key.replace(".", "/")
        subprocess.run(
            ["ip", "netns", "exec", namespace, "sh", "-c", f"echo {value} > {path}"],
            check=True,
            capture_output=True,
            timeout=IP_TIMEOUT_S,
        )

    def close(self) -> None:
        """Stop the proxies, kill what still runs in the namespaces, remove namespaces, veths and bridge."""
        for link in self.slow_links:
            _stop(link.proxy)
        self.slow_links.clear()
        for kind, name in reversed(self._created):
            if kind == "netns":
                _kill_namespace_processes(name)
                ip("netns", "delete", name, check=False)
            else:
                ip("link", "delete", name, check=False)
        self._created.clear()
        self.cuts.clear()

    # -- cuts --------------------------------------------------------------------------------------

    def cut(self, sender: str, receiver: str) -> None:
        """Drop every packet ``sender`` sends to ``receiver`` (one direction of the link)."""
        if (sender, receiver) in self.cuts:
            return
        ip("-n", self.namespace(sender), "route", "add", "blackhole", f"{self.addresses[receiver]}/32")
        self.cuts.add((sender, receiver))

    def restore(self, sender: str, receiver: str) -> None:
        if (sender, receiver) not in self.cuts:
            return
        ip("-n", self.namespace(sender), "route", "delete", "blackhole", f"{self.addresses[receiver]}/32")
        self.cuts.discard((sender, receiver))

    def partition(self, *sides: list[str]) -> None:
        """Cut both directions between every two nodes on different sides (nodes on no side keep all links)."""
        for index, side in enumerate(sides):
            for other in sides[index + 1 :]:
                for a in side:
                    for b in other:
                        self.cut(a, b)
                        self.cut(b, a)

    def heal(self) -> None:
        """Restore every cut and stop every slow link."""
        for sender, receiver in sorted(self.cuts):
            self.restore(sender, receiver)
        while self.slow_links:
            self._unslow(self.slow_links.pop())

    # -- slow links --------------------------------------------------------------------------------

    def slow(self, sender: str, receiver: str, port: int, delay_ms: int) -> None:
        """Delay, by ``delay_ms`` each way, the TCP connections ``sender`` opens to ``receiver``:``port``."""
        namespace = self.namespace(sender)
        address = self.addresses[receiver]
        log = open(self.log_dir / f"slow-{sender}-{receiver}.log", "ab")  # noqa: SIM115 (closed by the child's exit)
        proxy = subprocess.Popen(
            [*self.command_prefix(sender), sys.executable, "-m", "tests.fault.slow_link",
             "--port", str(port), "--delay-ms", str(delay_ms), "--mark", str(SLOW_LINK_MARK)],
            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True,
        )  # fmt: skip
        log.close()
        link = SlowLink(sender, receiver, port, delay_ms, proxy)
        self.slow_links.append(link)
        _await_ready(proxy)
        ip("-n", namespace, "route", "add", "local", f"{address}/32", "dev", "lo",
           "src", self.addresses[sender], "table", str(SLOW_LINK_TABLE))  # fmt: skip
        ip("-n", namespace, "rule", "add", "to", f"{address}/32", "ipproto", "tcp", "dport", str(port),
           "lookup", str(SLOW_LINK_TABLE), "pref", "101")  # fmt: skip

    def _unslow(self, link: SlowLink) -> None:
        namespace = self.namespace(link.sender)
        address = self.addresses[link.receiver]
        ip("-n", namespace, "rule", "delete", "to", f"{address}/32", "ipproto", "tcp", "dport", str(link.port),
           "lookup", str(SLOW_LINK_TABLE), "pref", "101", check=False)  # fmt: skip
        ip("-n", namespace, "route", "delete", "local", f"{address}/32", "table", str(SLOW_LINK_TABLE), check=False)
        _stop(link.proxy)


def _await_ready(proxy: subprocess.Popen) -> None:
    """The proxy prints one line once it listens; anything else (or silence) is a failure."""
    deadline = time.monotonic() + PROXY_READY_TIMEOUT_S
    assert proxy.stdout is not None
    os.set_blocking(proxy.stdout.fileno(), False)
    line = b""
    while time.monotonic() < deadline:
        chunk = proxy.stdout.read(64) or b""
        line += chunk
        if b"\n" in line:
            if line.startswith(b"listening"):
                return
            break
        if proxy.poll() is not None:
            break
        time.sleep(0.02)
    _stop(proxy)
    raise RuntimeError(f"the slow-link proxy did not start: {line!r}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)
    if process.stdout is not None:
        process.stdout.close()
