"""A local stand-in for Kubernetes, for tests and for trying Tandem on one machine.

Not a Kubernetes: no kube-apiserver runs on these machines, so this package
serves the parts of the Kubernetes API that Tandem's operator, its chart and
`kubectl` rely on (README.md beside this file says which, and which not).

* ``devcluster.apiserver`` — the API server over real HTTP (kmock's scaffold),
  run in a thread (`RunningApiServer`) or as ``python -m devcluster``;
* ``devcluster.store`` — objects with Kubernetes' write semantics;
* ``devcluster.kinds`` — the built-in kinds served, kinds from a CRD;
* ``devcluster.schema`` — a CRD's structural schema: prune, default, validate, CEL;
* ``devcluster.semantics`` — selectors, patches, printer-column JSONPath;
* ``devcluster.controllers`` — the controllers a real cluster runs, as far as
  Tandem relies on them (Deployment, ReplicaSet, DaemonSet, LeaderWorkerSet,
  EndpointSlice), on the server's loop.

It is no part of Tandem's control plane: it imports neither ``services`` nor
``operators`` (tests/test_layers.py); the launcher (``tandem``) may import it.
"""

from pathlib import Path

# Where `python -m devcluster` and `tandem cluster` keep its kubeconfig and log.
DEFAULT_STATE_DIR = Path.home() / ".cache" / "tandem" / "cluster"
