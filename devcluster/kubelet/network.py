"""The pod network: a Linux bridge, one network namespace per pod, real pod IPs.

Each pod gets a network namespace (`ip netns`) joined to the bridge by a veth
pair, with an address from the pod range (the lower half of the CIDR), so its
containers bind their ports unchanged and `status.podIP` is real. ClusterIPs
come from the upper half and are added to the bridge, where the host's service
proxy (proxy.py) listens on them; the bridge's first address is the gateway,
where pods reach the API server. Nothing is routed off the machine (no NAT,
no forwarding is turned on).

Names a pod resolves come from its own hosts file, /etc/netns/<netns>/hosts,
which `ip netns exec` bind-mounts over /etc/hosts; it is rewritten in place
(the bind mount pins the inode). Its resolv.conf has Kubernetes' search path
and no reachable nameserver.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and the `ip` tool; `check()`
says which is missing.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from pathlib import Path

NETNS_PREFIX = "tandem-"
VETH_PREFIX = "tdv"
ETC_NETNS = Path("/etc/netns")


class NetworkError(RuntimeError):
    """The pod network cannot be set up here."""


def check() -> None:
    """Raise NetworkError naming what is missing for the pod network."""
    missing = [tool for tool in ("ip", "nsenter", "mount") if shutil.which(tool) is None]
    if missing:
        raise NetworkError(f"the pod network needs {', '.join(missing)} on PATH (iproute2)")
    if os.geteuid() != 0:
        raise NetworkError(
            "the pod network needs root (CAP_NET_ADMIN for the bridge, veth pairs and "
            "network namespaces, CAP_SYS_ADMIN for the pods' mounts); run as root or "
            "start the cluster without pods (--no-kubelet)"
        )


def ip(*args: str, netns: str | None = None, check: bool = True) -> None:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise NetworkError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")


class Network:
    """The bridge, the pods' namespaces and the ClusterIPs on one machine."""

    def __init__(self, cidr: str = "10.250.0.0/16", bridge: str = "tandem0") -> None:
        self.net = ipaddress.ip_network(cidr)
        if self.net.version != 4 or self.net.prefixlen > 24:
            raise NetworkError(f"--pod-cidr must be an IPv4 network of /24 or larger: {cidr}")
        self.bridge = bridge
        pods, services = self.net.subnets(prefixlen_diff=1)
        self.gateway = str(pods.network_address + 1)
        self._pod_ips = (str(a) for a in pods.hosts() if str(a) != self.gateway)
        self._free_pod_ips: list[str] = []
        self._cluster_ips = (str(a) for a in services.hosts())
        self._free_cluster_ips: list[str] = []
        self.pods: dict[str, tuple[str, str]] = {}  # key → (netns, ip)
        self.cluster_ips: set[str] = set()
        self._next = 0

    # ---- the bridge ------------------------------------------------------------

    def up(self) -> None:
        check()
        if Path(f"/sys/class/net/{self.bridge}").exists():
            raise NetworkError(
                f"the bridge {self.bridge} exists already: another devcluster runs "
                f"(or one was killed; `ip link del {self.bridge}` removes it), or pick "
                "another with --bridge"
            )
        # No forwarding delay: with the default 15 s a new pod is unreachable that long.
        ip("link", "add", self.bridge, "type", "bridge", "forward_delay", "0")
        ip("addr", "add", f"{self.gateway}/{self.net.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def down(self) -> None:
        """Remove every pod namespace, the ClusterIPs and the bridge."""
        for key in list(self.pods):
            self.remove_pod(key)
        ip("link", "del", self.bridge, check=False)
        self.cluster_ips.clear()

    # ---- pods ------------------------------------------------------------------

    def add_pod(self, key: str, hostname: str, namespace: str) -> tuple[str, str]:
        """A network namespace with an address on the bridge: (netns, ip)."""
        if key in self.pods:
            return self.pods[key]
        address = self._free_pod_ips.pop() if self._free_pod_ips else next(self._pod_ips)
        self._next += 1
        # Interface names have 15 characters at most.
        suffix = f"{os.getpid() % 10000}x{self._next}"
        netns, veth = f"{NETNS_PREFIX}{suffix}", f"{VETH_PREFIX}{suffix}"
        ip("netns", "add", netns)
        try:
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
            ip("link", "set", veth, "master", self.bridge)
            ip("link", "set", veth, "up")
            ip("addr", "add", f"{address}/{self.net.prefixlen}", "dev", "eth0", netns=netns)
            ip("link", "set", "eth0", "up", netns=netns)
            ip("link", "set", "lo", "up", netns=netns)
            # A default route via the gateway, as a real pod has: programs find
            # their own address by "connecting" a UDP socket outward (vLLM's
            # get_ip; without the route it falls back to 0.0.0.0 and Mooncake
            # registers its segment there). Nothing leaves the machine: the host
            # does not forward (ip_forward stays 0). A lookup of a name outside
            # the hosts file fails at once (the resolver on 127.0.0.1 refuses).
            ip("route", "add", "default", "via", self.gateway, netns=netns)
            folder = ETC_NETNS / netns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(f"127.0.0.1\tlocalhost\n{address}\t{hostname}\n")
            (folder / "resolv.conf").write_text(
                f"search {namespace}.svc.cluster.local svc.cluster.local cluster.local\n"
                "nameserver 127.0.0.1\noptions ndots:5\n"
            )
        except BaseException:
            ip("netns", "del", netns, check=False)
            shutil.rmtree(ETC_NETNS / netns, ignore_errors=True)
            raise
        self.pods[key] = (netns, address)
        return netns, address

    def remove_pod(self, key: str) -> None:
        """The veth pair (deleting the host's end deletes both), then the
        namespace. `ip netns del` alone only unmounts it: while the kernel
        still holds it (sockets of exited processes, seen with the engines'
        KV transfer) it lives on, and the pair with it."""
        if key not in self.pods:
            return
        netns, address = self.pods.pop(key)
        ip("link", "del", VETH_PREFIX + netns.removeprefix(NETNS_PREFIX), check=False)
        ip("netns", "del", netns, check=False)
        shutil.rmtree(ETC_NETNS / netns, ignore_errors=True)
        self._free_pod_ips.append(address)

    def write_hosts(self, key: str, text: str) -> None:
        """Replace a pod's hosts file in place: the bind mounts hold its inode."""
        if key not in self.pods:
            return
        path = ETC_NETNS / self.pods[key][0] / "hosts"
        if path.read_text() == text:
            return
        with path.open("r+") as f:
            f.write(text)
            f.truncate()

    # ---- ClusterIPs --------------------------------------------------------------

    def add_cluster_ip(self) -> str:
        address = (
            self._free_cluster_ips.pop() if self._free_cluster_ips else next(self._cluster_ips)
        )
        ip("addr", "add", f"{address}/32", "dev", self.bridge)
        self.cluster_ips.add(address)
        return address

    def remove_cluster_ip(self, address: str) -> None:
        if address in self.cluster_ips:
            ip("addr", "del", f"{address}/32", "dev", self.bridge, check=False)
            self.cluster_ips.discard(address)
            self._free_cluster_ips.append(address)
