"""API keys and prompt/completion text never reach a log at the default
level: the real router process (API keys on, default log level) before one
fake engine whose every token reads as a recognisable word, driven through
every endpoint (streaming or not, errors included), then every log the
processes wrote is searched for the key, the prompt and the completion.
No mocks; about 15 s."""

from __future__ import annotations

import logging
import secrets

import httpx
from fastapi import FastAPI

from services.router.errors import WithholdMessages, install_error_handlers
from tests.router.fuzz_helpers import live_router

MODEL = "SmolLM2-135M-Instruct"


def test_no_key_or_text_in_any_log(tmp_path):
    tag = secrets.token_hex(6)
    key = f"sk-hygiene-key-{tag}"
    wrong_key = f"sk-hygiene-wrong-{tag}"
    prompt = f"Pelican-prompt-{tag}"
    # The completion: the fake engine's every token; an unterminated
    # <tool_call> so the tool parser fails on it, the path most likely to log.
    completion_word = f"Marmoset{tag}"
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{key}\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    with live_router(
        logs, "--api-keys-file", str(keys_file), token_text=f"<tool_call>{completion_word}"
    ) as live:
        client = live.client
        client.headers["Authorization"] = f"Bearer {key}"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        answers = [
            client.post("/v1/chat/completions", json=chat),
            client.post("/v1/chat/completions", json={**chat, "stream": True}),
            client.post("/v1/chat/completions", json={**chat, "tools": [tool]}),
            client.post("/v1/chat/completions", json={**chat, "tools": [tool], "stream": True}),
            client.post(
                "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4}
            ),
            client.post(
                "/v1/messages",
                json={"model": MODEL, "max_tokens": 4, "messages": chat["messages"]},
            ),
            client.post("/tokenize", json={"model": MODEL, "prompt": prompt}),
        ]
        responses = {"model": MODEL, "max_output_tokens": 4}
        first = client.post("/v1/responses", json={**responses, "input": prompt})
        answers += [
            first,
            client.post(
                "/v1/responses",
                json={**responses, "input": prompt, "previous_response_id": first.json()["id"]},
            ),
        ]
        assert [a.status_code for a in answers] == [200] * len(answers), [
            a.text for a in answers if a.status_code != 200
        ]
        assert completion_word in answers[0].text  # the words to look for really passed
        refusals = [
            # Bad input quoting the prompt: a role that does not exist,
            # a body that is not JSON, a wrong model.
            client.post(
                "/v1/chat/completions",
                json={**chat, "messages": [{"role": "wizard", "content": prompt}]},
            ),
            client.post("/v1/chat/completions", content=f'{{"messages": "{prompt}'),
            client.post("/v1/completions", json={"model": prompt, "prompt": prompt}),
            httpx.post(
                f"{live.url}/v1/chat/completions",
                json=chat,
                headers={"Authorization": f"Bearer {wrong_key}"},
            ),
        ]
        assert [r.status_code for r in refusals] == [400, 400, 404, 401], [r.text for r in refusals]
    written = {path.name: path.read_text(errors="replace") for path in logs.iterdir()}
    assert "router ready" in written["router.log"], written  # the logs are the real ones
    for name, text in written.items():
        for secret in (key, wrong_key, tag):
            assert secret not in text, f"{name} holds {secret!r}:\n{text}"


async def test_an_unhandled_error_logs_no_request_text(caplog):
    """A crash's message may quote the request: the log keeps the type and
    the frames, not the message."""
    prompt = f"Pelican-prompt-{secrets.token_hex(6)}"
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat():
        raise ValueError(f"cannot render {prompt!r}")

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    with caplog.at_level(logging.INFO):
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            response = await client.post("/v1/chat/completions", json={})
    assert response.status_code == 500
    formatted = "\n".join(logging.Formatter().format(r) for r in caplog.records)
    assert "ValueError" in formatted and "raise ValueError" in formatted  # type and frames
    assert prompt not in formatted


def test_uvicorn_tracebacks_lose_the_message():
    secret = f"Pelican-prompt-{secrets.token_hex(6)}"
    try:
        raise KeyError(secret)
    except KeyError as exc:
        record = logging.LogRecord(
            "uvicorn.error", logging.ERROR, __file__, 1, "Exception in ASGI application", (), None
        )
        record.exc_info = (type(exc), exc, exc.__traceback__)
    assert WithholdMessages().filter(record)
    text = logging.Formatter().format(record)
    assert "KeyError (message withheld" in text and "raise KeyError" in text
    assert secret not in text
