"""The controllers a real cluster runs, as far as Tandem relies on them.

They run in-process, on the API server's event loop, against its store
(runner.py says how), so they need no client, no credentials and no second
process, and each write is an ordinary write: resourceVersion, watch events,
validation, garbage collection. One module per controller:

* ``deployment`` — Deployment → ReplicaSets (RollingUpdate, Recreate, status);
* ``replicaset`` — ReplicaSet → pods, scale-down in the real ranking
  (``controller.kubernetes.io/pod-deletion-cost`` first);
* ``daemonset`` — one pod on the one node;
* ``job`` — Job → pods run to completion, counted against ``backoffLimit``,
  ``Complete``/``Failed``;
* ``lws`` — LeaderWorkerSet groups (leader + workers, ``LWS_*`` env);
* ``endpointslice`` — Services' EndpointSlices from pod readiness and deletion;
* ``scheduler`` — binds pods that name no node;
* ``node`` — the one Node (``devcluster-node``) every pod is bound to.

What runs pods (the kubelet) is not here: pods are created bound to the node
and stay Pending until something writes their status.
"""

from devcluster.controllers.base import NODE_NAME
from devcluster.controllers.runner import ControllerManager

__all__ = ["NODE_NAME", "ControllerManager"]
