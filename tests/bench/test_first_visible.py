"""bench.first_visible: the index of the first token with text, and a run's
prompts rebuilt in the order the simulator reads the indices."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from bench.first_visible import first_text_index, run_prompts
from sim.cluster import ClusterConfig, Simulation, Traffic
from sim.engine import EngineSettings
from sim.validation import engines_model
from tandem.workload.content import PromptBuilder
from tandem.workload.generate import generate, params_dict, params_for


class _Call:
    """A Generate call's stream of messages (token ids, text)."""

    def __init__(self, messages):
        self.messages = [SimpleNamespace(token_ids=ids, text=text) for ids, text in messages]
        self.cancelled = False

    def __iter__(self):
        return iter(self.messages)

    def cancel(self):
        self.cancelled = True


class _Stub:
    def __init__(self, messages):
        self.call = _Call(messages)
        self.requests = []

    def Generate(self, request, timeout):  # noqa: N802 — the gRPC method's name
        self.requests.append(request)
        return self.call


@pytest.mark.parametrize(
    "messages, index",
    [
        ([([9], "The")], 0),
        ([([2], ""), ([198], "\n")], 1),
        ([([2], ""), ([1], ""), ([9690], "system")], 2),
        ([([2, 7], "x")], 1),  # text with a message's last token: the client's chunk
        ([([2], ""), ([2], "")], 4),  # none within max_tokens
    ],
)
def test_the_first_token_with_text_is_found_and_the_call_cancelled(messages, index):
    stub = _Stub(messages)
    assert first_text_index(stub, [1, 2, 3], 4, timeout=5) == index
    sampling = stub.requests[0].sampling_params
    assert sampling.temperature == 0.0 and sampling.ignore_eos and sampling.skip_special_tokens
    assert stub.call.cancelled


def test_a_runs_prompts_come_per_session_in_the_order_the_simulator_reads_them(model_dir):
    """The prompts of a run.json's trace, with its records' max_tokens: per
    session one entry a request; their indices drive the simulation."""
    params = params_for("small", sessions=3, seed=0, turns_median=4)
    sessions = generate(params)
    run = {
        "trace": {"params": params_dict(params)},
        "records": [
            {"session": s.id, "agent": "/".join(path), "turn": turn, "max_tokens": 7}
            for s in sessions
            for path, turn, _ in s.iter_requests()
        ],
    }
    builder = PromptBuilder(AutoTokenizer.from_pretrained(str(model_dir)), salt="fv")
    prompts = run_prompts(run, builder)
    assert list(prompts) == [s.id for s in sessions]
    for s in sessions:
        requests = [r for _, _, r in s.iter_requests()]
        assert len(prompts[s.id]) == len(requests)
        assert all(n == 7 for _, n in prompts[s.id])
    indices = tuple((sid, tuple(1 for _ in ps)) for sid, ps in prompts.items())
    traffic = Traffic(sessions=3, turns_median=4, first_visible=indices)
    config = ClusterConfig(engine=EngineSettings(kv_blocks=182), model=engines_model())
    assert Simulation(config, traffic).run()["requests"] == len(run["records"])
