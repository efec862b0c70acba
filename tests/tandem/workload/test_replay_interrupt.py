"""Ctrl-C during a replay returns what was measured: in-flight requests are
recorded as interrupted (not failures) and the result says it was interrupted.
The endpoint is a real TCP listener that accepts and never answers (a hung
server), so no model server is needed."""

from __future__ import annotations

import asyncio
import os
import signal

from transformers import AutoTokenizer

from common.model import resolve_model
from tandem.workload import metrics
from tandem.workload.content import PromptBuilder
from tandem.workload.generate import generate, params_for
from tandem.workload.replay import ReplayConfig, Replayer, build_prompts


async def test_sigint_returns_partial_results():
    held = []

    async def hang(reader, writer):
        held.append(writer)  # read nothing, answer nothing

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tok = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    sessions = generate(params_for("small", sessions=3, seed=4))
    prompts = build_prompts(sessions, PromptBuilder(tok, salt="int"))
    cfg = ReplayConfig(
        url=f"http://127.0.0.1:{port}", model="m", concurrency=2, progress=False, timeout_s=120
    )
    replayer = Replayer(cfg, sessions, prompts, salt="int")
    task = asyncio.create_task(replayer.run())
    for _ in range(200):  # until both lanes have a request in flight
        await asyncio.sleep(0.05)
        if len(held) >= 2:
            break
    assert len(held) >= 2, "requests never reached the listener"
    os.kill(os.getpid(), signal.SIGINT)
    result = await asyncio.wait_for(task, 30)
    server.close()
    for w in held:
        w.close()
    assert result.interrupted
    s = metrics.summarize([r.__dict__ for r in result.records])
    assert s["interrupted"] == 2 and s["failures"] == 0 and s["ok"] == 0
    assert {r.error for r in result.records} == {"interrupted"}
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
