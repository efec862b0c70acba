"""The pod network's own teardown, as root (tests/devcluster/test_kubelet.py
covers it through a whole cluster)."""

from __future__ import annotations

import os
import subprocess
import sys

from devcluster.kubelet.network import NETNS_PREFIX, VETH_PREFIX, Network


def test_a_removed_pod_leaves_no_link_while_its_namespace_is_still_held():
    # Something still holding the namespace (here an open handle; after real
    # pods, the kernel's sockets of their exited processes) keeps it alive
    # after `ip netns del`: its veth pair must not stay on the bridge.
    network = Network(cidr="10.241.0.0/16", bridge=f"tdnet{os.getpid() % 10000}")
    network.up()
    try:
        netns, _ = network.add_pod("default/held", "held", "default")
        veth = VETH_PREFIX + netns.removeprefix(NETNS_PREFIX)
        assert veth in os.listdir("/sys/class/net")
        handle = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            network.remove_pod("default/held")
            assert veth not in os.listdir("/sys/class/net")
        finally:
            os.close(handle)
    finally:
        network.down()
    assert network.bridge not in os.listdir("/sys/class/net")


def test_a_pod_finds_its_own_address_as_vllm_does():
    # vLLM (get_ip) and others learn their address by "connecting" a UDP
    # socket outward; with no route that fails and they announce 0.0.0.0.
    network = Network(cidr="10.242.0.0/16", bridge=f"tdip{os.getpid() % 10000}")
    network.up()
    try:
        netns, address = network.add_pod("default/ip", "ip", "default")
        probe = (
            "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
            "s.connect(('8.8.8.8', 80)); print(s.getsockname()[0])"
        )
        seen = subprocess.run(
            ["ip", "netns", "exec", netns, sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
        assert seen == address
    finally:
        network.down()
