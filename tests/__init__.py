"""Tandem's tests (see tests/conftest.py)."""

import os

# The tests start many processes (fork + exec) from a process that uses gRPC.
# gRPC's fork handlers can deadlock such a fork when it races one of gRPC's
# own threads (seen in CI: a router launch hung for good in grpc_prefork
# while a grpc_shutdown thread ran). Nothing here uses gRPC in a forked child
# without exec, which is all the handlers are for; set before gRPC is loaded.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
