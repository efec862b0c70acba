"""Services as pods and the host reach them: a ClusterIP and a loopback port per
Service port, proxied to the ready endpoints of its EndpointSlices (proxy.py),
a loopback port per Ingress (to its backend Service's endpoints), and the
names in each pod's hosts file. The ports are printed and kept in the state
file (services.json: "<ns>/<service>" → clusterIP and ports, "ingresses")."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from devcluster.kubelet.network import Network
from devcluster.kubelet.proxy import Forwarder

log = logging.getLogger("devcluster.kubelet")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
Key = tuple[str, str]


def port_key(port: dict) -> str:
    return port.get("name") or str(port["port"])


class Services:
    def __init__(self, network: Network, state_file: Path) -> None:
        self.network = network
        self.state_file = state_file
        self.cluster_ips: dict[Key, str] = {}
        # (namespace, name, port key) → (forwarder, service port, loopback port)
        self.forwarders: dict[tuple[str, str, str], tuple[Forwarder, int, int]] = {}
        self.slices: dict[Key, dict] = {}
        # Ingress → (forwarder, "service:port" it sends to, loopback port)
        self.ingresses: dict[Key, tuple[Forwarder, str, int]] = {}

    def endpoints(
        self, namespace: str, service: str, port_name: str | None
    ) -> list[tuple[str, int]]:
        """Ready (ready unset counts as ready) addresses and ports of a Service port."""
        found = []
        for (ns, _), eps in sorted(self.slices.items()):
            if (
                ns != namespace
                or eps["metadata"].get("labels", {}).get(SERVICE_NAME_LABEL) != service
            ):
                continue
            ports = [
                p for p in eps.get("ports") or [] if (p.get("name") or None) == (port_name or None)
            ]
            if not ports or ports[0].get("port") is None:
                continue
            for ep in eps.get("endpoints") or []:
                if (ep.get("conditions") or {}).get("ready") is False:
                    continue
                found.extend((addr, int(ports[0]["port"])) for addr in ep.get("addresses", []))
        return found

    async def sync(
        self, services: dict[Key, dict], slices: dict[Key, dict], ingresses: dict[Key, dict]
    ) -> None:
        self.slices = slices
        await self._sync_services(services)
        await self._sync_ingresses(services, ingresses)
        self._write_state()

    async def _sync_ingresses(self, services: dict[Key, dict], ingresses: dict[Key, dict]) -> None:
        """One loopback port per Ingress, to the Service port of its default
        backend (or its first rule's first path): no host or path routing."""
        wanted: dict[Key, tuple[str, str | None]] = {}
        for (ns, name), ing in ingresses.items():
            spec = ing.get("spec", {})
            backend = spec.get("defaultBackend")
            for rule in spec.get("rules", []):
                for path in (rule.get("http") or {}).get("paths", []):
                    backend = backend or path.get("backend")
            target = (backend or {}).get("service")
            svc = services.get((ns, (target or {}).get("name", "")))
            if target is None or svc is None:
                continue
            want = target.get("port", {})
            port = next(
                (
                    p
                    for p in svc.get("spec", {}).get("ports", [])
                    if p.get("name") == want.get("name") or p["port"] == want.get("number")
                ),
                None,
            )
            if port is not None:
                wanted[(ns, name)] = (f"{target['name']}:{port['port']}", port.get("name"))
        for key in list(self.ingresses):
            if key not in wanted or self.ingresses[key][1] != wanted[key][0]:
                await self.ingresses.pop(key)[0].close()
        for (ns, name), (backend, port_name) in wanted.items():
            if (ns, name) in self.ingresses:
                continue
            service = backend.split(":")[0]
            forwarder = Forwarder(
                lambda ns=ns, svc=service, p=port_name: self.endpoints(ns, svc, p)
            )
            loopback = await forwarder.listen("127.0.0.1", 0)
            self.ingresses[(ns, name)] = (forwarder, backend, loopback)
            print(
                f"devcluster: ingress {ns}/{name} → service {backend}: host 127.0.0.1:{loopback}",
                flush=True,
            )

    async def _sync_services(self, services: dict[Key, dict]) -> None:
        wanted: dict[tuple[str, str, str], dict] = {}
        for (ns, name), svc in services.items():
            spec = svc.get("spec", {})
            if spec.get("type") == "ExternalName" or spec.get("clusterIP") == "None":
                continue
            if (ns, name) not in self.cluster_ips:
                self.cluster_ips[(ns, name)] = self.network.add_cluster_ip()
            for port in spec.get("ports", []):
                if port.get("protocol", "TCP") == "TCP":
                    wanted[(ns, name, port_key(port))] = port
        for key in [k for k in self.forwarders if k not in wanted]:
            forwarder, _, _ = self.forwarders.pop(key)
            await forwarder.close()
        for key in [k for k in self.cluster_ips if k not in services or _headless(services[k])]:
            self.network.remove_cluster_ip(self.cluster_ips.pop(key))
        for key, port in wanted.items():
            if key in self.forwarders and self.forwarders[key][1] == port["port"]:
                continue
            if key in self.forwarders:
                await self.forwarders.pop(key)[0].close()
            ns, name, _ = key
            name_of_port = port.get("name")
            forwarder = Forwarder(
                lambda ns=ns, name=name, p=name_of_port: self.endpoints(ns, name, p)
            )
            try:
                await forwarder.listen(self.cluster_ips[(ns, name)], port["port"])
                loopback = await forwarder.listen("127.0.0.1", 0)
            except OSError as exc:
                log.warning("service %s/%s port %s: %s", ns, name, port["port"], exc)
                await forwarder.close()
                continue
            self.forwarders[key] = (forwarder, port["port"], loopback)
            print(
                f"devcluster: service {ns}/{name} port {port['port']}: "
                f"{self.cluster_ips[(ns, name)]}:{port['port']}, host 127.0.0.1:{loopback}",
                flush=True,
            )

    def _write_state(self) -> None:
        state: dict[str, Any] = {}
        for (ns, name), ip in sorted(self.cluster_ips.items()):
            state[f"{ns}/{name}"] = {"clusterIP": ip, "ports": {}}
        for (ns, name, key), (_, port, loopback) in sorted(self.forwarders.items()):
            state[f"{ns}/{name}"]["ports"][key] = {"port": port, "loopback": loopback}
        state["ingresses"] = {
            f"{ns}/{name}": {"backend": backend, "loopback": loopback}
            for (ns, name), (_, backend, loopback) in sorted(self.ingresses.items())
        }
        # Whole or not at all: users and tests read it while it changes.
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_file)

    def loopback(self, namespace: str, name: str, port: str | int) -> int:
        """The host's loopback port for a Service port (by name or number)."""
        for (ns, svc, key), (_, number, loopback) in self.forwarders.items():
            if (ns, svc) == (namespace, name) and str(port) in (key, str(number)):
                return loopback
        raise KeyError(f"no proxied port {port} of service {namespace}/{name}")

    async def close(self) -> None:
        for forwarder, _, _ in self.forwarders.values():
            await forwarder.close()
        self.forwarders.clear()
        for forwarder, _, _ in self.ingresses.values():
            await forwarder.close()
        self.ingresses.clear()
        for ip in self.cluster_ips.values():
            self.network.remove_cluster_ip(ip)
        self.cluster_ips.clear()
        self.state_file.unlink(missing_ok=True)

    def hosts(
        self, namespace: str, own: tuple[str, str], services: dict[Key, dict], pods: list[dict]
    ) -> str:
        """A pod's hosts file: itself, every Service (headless ones: their ready
        pods), and pods with a hostname and subdomain (LeaderWorkerSet leaders)."""
        lines = [
            "127.0.0.1\tlocalhost",
            "::1\tlocalhost ip6-localhost ip6-loopback",
            "\t".join(own),
        ]

        def names(name: str, ns: str, extra: str = "svc") -> str:
            full = [f"{name}.{ns}", f"{name}.{ns}.{extra}", f"{name}.{ns}.{extra}.cluster.local"]
            return " ".join(([name] if ns == namespace else []) + full)

        # The API server: clients of in-cluster config (kopf) use its name.
        lines.append(f"{self.network.gateway}\t{names('kubernetes', 'default')}")

        for (ns, name), svc in sorted(services.items()):
            if (ns, name) in self.cluster_ips:
                lines.append(f"{self.cluster_ips[(ns, name)]}\t{names(name, ns)}")
            elif _headless(svc):
                for ip, _ in dict.fromkeys(self._any_port(ns, name)):
                    lines.append(f"{ip}\t{names(name, ns)}")
        for pod in pods:
            spec, status = pod.get("spec", {}), pod.get("status", {})
            if spec.get("hostname") and spec.get("subdomain") and status.get("podIP"):
                ns = pod["metadata"]["namespace"]
                host = f"{spec['hostname']}.{spec['subdomain']}"
                lines.append(f"{status['podIP']}\t{names(host, ns)}")
        return "\n".join(lines) + "\n"

    def _any_port(self, namespace: str, service: str) -> list[tuple[str, int]]:
        found = []
        for (ns, _), eps in self.slices.items():
            if (
                ns == namespace
                and eps["metadata"].get("labels", {}).get(SERVICE_NAME_LABEL) == service
            ):
                for ep in eps.get("endpoints") or []:
                    if (ep.get("conditions") or {}).get("ready") is not False:
                        found.extend((a, 0) for a in ep.get("addresses", []))
        return found


def _headless(svc: dict) -> bool:
    return svc.get("spec", {}).get("clusterIP") == "None"
