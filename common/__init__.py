"""The low package: what every layer above shares, importing none of them.

* ``common.proto`` — generated gRPC code of ``protos/common/proto/*.proto``
  (``make proto``; never edited by hand);
* ``common.logs`` — the one logging set-up of every service;
* ``common.model`` — preparation of the bundled default model;
* ``common.ports`` — free loopback ports for services started on this machine;
* ``common.procs`` — processes in their own process groups: start, wait until
  ready, stop with the whole group;
* ``common.roles`` — the roles an engine serves.

Layers (imports point down only): ``bench/`` (benchmarks, not shipped) →
``tandem/`` (the launcher) → ``services/``, ``operators/``, ``kernels/`` →
``common/``.
"""
