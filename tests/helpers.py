"""What several test files share: the model's name, the long prompt, small
clients of the running stack (chat, SSE, engine load and model info,
Prometheus samples), polling, and a client of the KV store that reads which
blocks it holds. Fixtures live in the conftest.py files; everything else a
second test file needs lives here, not in a test file or a conftest.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import httpx
from hypothesis import strategies as st

from common.model import DEFAULT_MODEL_NAME
from common.procs import Proc
from common.proto import engine_pb2 as pb
from common.proto import engine_pb2_grpc as pb_grpc
from devcluster import schema as crd
from operators.spec import crd_schema, parse, problems
from services.router.chat_templates import CHATML_TOOLS
from services.router.routing.hashing import BlockHasher
from tandem.workload.endpoint import sse_data

MODEL_NAME = DEFAULT_MODEL_NAME  # the name the stack serves the bundled model under
# A prompt of about 1,500 tokens: long enough to span many KV blocks.
LONG_CONTEXT = " ".join(
    f"Step {i}: the agent read file src/module_{i}.py and found {i * 7 % 13} issues."
    for i in range(90)
)
# The ChatML template with tool calls the router ships (SmolLM2's own ignores tools).
TOOLS_TEMPLATE = CHATML_TOOLS
# KV block size of the shared aggregated engines (tests/conftest.py): small,
# so a short prompt still spans many blocks.
AGGREGATED_BLOCK_SIZE = 32


def engine(stack, role: str) -> Proc:
    """The stack's first engine of `role` ("prefill", "decode", "engine")."""
    return next(p for p in stack.procs if p.name.startswith(role))


def chat(url: str, model: str, content: str, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)


def sse_events(response: httpx.Response) -> list[str]:
    """The data payloads of a server-sent event stream, checking its framing:
    every event is one ``data:`` line."""
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        data = sse_data(block)
        assert data is not None and "\n" not in block, f"malformed SSE block: {block!r}"
        events.append(data)
    return events


def stream_text(events: list[str], field: str = "chat") -> str:
    text = []
    for data in events[:-1]:
        chunk = json.loads(data)
        for choice in chunk["choices"]:
            text.append(choice["delta"].get("content", "") if field == "chat" else choice["text"])
    return "".join(text)


def engine_load(address: str) -> pb.GetLoadResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.EngineStub(channel).GetLoad(pb.GetLoadRequest(), timeout=5)


def wait_for(predicate, timeout: float, interval: float = 0.2):
    """Poll until predicate() is truthy; return its last value."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


def metric_value(text: str, name: str, labels: str = "") -> float:
    """A sample's value from Prometheus text (0 when absent)."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


def engine_info(address: str) -> pb.GetModelInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.EngineStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)


# -- the KV store, block by block -------------------------------------------------


class StoreClient:
    """What the KV store holds, block by block, for the KV store tests.

    A Mooncake client of its own (segment size 0, like an engine) asks the store
    about the keys vLLM's MooncakeStoreConnector writes for a prompt: the test
    computes the prompt's block hashes as vLLM does (the router's BlockHasher)
    and builds the connector's key format
    (``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/data.py``,
    ``PoolKey``; single rank, group 0). If that format changes, ``wait_written``
    fails loudly: no block ever appears.

    Every existence check or replica lookup grants the object a read lease
    (the store's ``--lease-ttl-ms``), which keeps it from being evicted and makes
    it recent in LRU order: check before and after pressure, not during it.
    """

    def __init__(self, engine_config: str | Path, model: str, block_size: int = 128) -> None:
        from mooncake.store import MooncakeDistributedStore

        cfg = json.loads(Path(engine_config).read_text())
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            "127.0.0.1",
            cfg["metadata_server"],
            0,
            16 << 20,
            "tcp",
            "",
            cfg["master_server_address"],
        )
        assert rc == 0, f"Mooncake client setup failed: {rc}"
        self.prefix = f"{model}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"
        self.hasher = BlockHasher(block_size)

    def close(self) -> None:
        self.store.close()

    def keys(self, token_ids: list[int]) -> list[str]:
        """The store keys of the prompt's full blocks, in order."""
        return [self.prefix + h.hex() for h in self.hasher.block_hashes(token_ids)]

    def present(self, keys: list[str]) -> list[bool]:
        return [r == 1 for r in self.store.batch_is_exist(keys)]

    def tiers(self, keys: list[str]) -> list[set[str]]:
        """Per key, the tiers holding a replica: "memory", "disk" (empty: gone)."""
        descs = self.store.batch_get_replica_desc(keys)
        out = []
        for key in keys:
            tiers = set()
            for d in descs.get(key, []):
                if d.is_memory_replica():
                    tiers.add("memory")
                elif d.is_disk_replica() or d.is_local_disk_replica():
                    tiers.add("disk")
            out.append(tiers)
        return out

    def wait_written(self, keys: list[str], timeout: float = 120) -> None:
        """Puts are asynchronous to the request: wait until every key is there."""
        deadline = time.monotonic() + timeout
        while not all(present := self.present(keys)):
            assert time.monotonic() < deadline, (
                f"blocks never reached the store: {present} (if none did, the key "
                "format of vLLM's store connector changed)"
            )
            time.sleep(0.5)


def assert_spec_refused(spec: dict, fragment: str) -> None:
    """The operator's ``problems`` name the fault (``fragment``), and the
    CRD's own schema and CEL rules refuse the same TandemDeployment spec."""
    found = problems(parse(spec))
    assert any(fragment in p for p in found), found
    body = {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "TandemDeployment",
        "metadata": {"name": "demo"},
        "spec": spec,
    }
    _, _, errors = crd.admit(crd_schema("tandemdeployments"), body)
    assert errors, "the CRD's own rules refuse the same spec"


# Hypothesis strategies: JSON values an agent API client could send (no NaN or
# infinity: JSON cannot carry them), with the keys and words those APIs use, so
# fuzzed bodies reach past the first check.
JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(
        [
            "",
            "x",
            "user",
            "assistant",
            "text",
            "tool_use",
            "tool_result",
            "function",
            "function_call",
            "function_call_output",
            "message",
            "input_text",
            "json_schema",
            "object",
            "auto",
            "any",
            "tool",
            "required",
            "none",
            "call_1",
            "toolu_1",
            "m",
        ]
    )
)
_JSON_KEYS = st.sampled_from(
    [
        "type",
        "role",
        "content",
        "text",
        "id",
        "name",
        "input",
        "input_schema",
        "tool_use_id",
        "is_error",
        "call_id",
        "arguments",
        "output",
        "parameters",
        "format",
        "schema",
        "properties",
        "disable_parallel_tool_use",
        "user_id",
        "strict",
    ]
)
ANY_JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_JSON_KEYS, inner, max_size=5),
    max_leaves=20,
)


# The two tools the agent-API stack tests offer (chat, Messages, Responses
# each wrap them in their own tool format): parameter schemas by tool name.
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_PARAMS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOL_PARAMS = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}


def chat_completion(message: dict, finish: str, usage: dict) -> dict:
    """A non-streamed chat completion with one choice, as the router's chat
    path returns it (the input of the Messages and Responses translations)."""
    return {
        "id": "chatcmpl-abc",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage,
    }
