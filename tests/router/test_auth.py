"""Optional API keys (services/router/auth.py): the real router app from
`create_app` (its lifespan, which needs engines, is never run) and the
flags/file/environment that configure the keys. Fast; no engines."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from services.router.app import create_app, install_middleware
from services.router.auth import read_keys_file
from services.router.config import RouterSettings, parse_settings
from services.router.metrics import RouterMetrics
from tests.helpers import metric_value

KEYS = ("key-one", "key-two")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


@pytest.fixture
def router():
    return client(create_app(RouterSettings(engines=["fake:1"], api_keys=KEYS)))


def assert_401(response: httpx.Response, sent_key: str | None = None) -> str:
    assert response.status_code == 401, response.text
    assert response.headers["WWW-Authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    if sent_key:
        assert sent_key not in response.text  # never echoed
    return error["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_missing_key_is_401(router, path):
    message = assert_401(await router.post(path, json=CHAT))
    assert "Missing API key" in message and "Authorization: Bearer" in message


async def test_wrong_key_is_401_without_echo(router):
    wrong = "sk-wrong-secret-123"
    message = assert_401(
        await router.get("/v1/models", headers={"Authorization": f"Bearer {wrong}"}), sent_key=wrong
    )
    assert message == "Incorrect API key provided"
    # A prefix or extension of a real key is not that key.
    for near in ("key-on", "key-one2"):
        assert_401(await router.get("/v1/models", headers={"Authorization": f"Bearer {near}"}))


@pytest.mark.parametrize("header", ["Basic a2V5LW9uZQ==", "Bearer", "key-one", "Bearer "])
async def test_malformed_header_is_401(router, header):
    message = assert_401(await router.get("/v1/models", headers={"Authorization": header}))
    assert "Bearer" in message


@pytest.mark.parametrize("key", KEYS)
async def test_right_key_reaches_the_endpoint(router, key):
    # An empty body fails validation in the endpoint: a 400, not a 401, shows
    # that the key was accepted and the request got past the middleware.
    response = await router.post(
        "/v1/chat/completions", json={}, headers={"Authorization": f"bearer {key}"}
    )
    assert response.status_code == 400, response.text


async def test_metrics_stay_open_and_count_failures(router):
    await router.get("/v1/models")
    await router.get("/v1/models", headers={"Authorization": "Bearer nope"})
    await router.get("/v1/models", headers={"Authorization": "Bearer nope"})
    response = await router.get("/metrics")
    assert response.status_code == 200
    assert metric_value(response.text, "tandem_router_auth_failures_total", 'reason="missing"') == 1
    assert metric_value(response.text, "tandem_router_auth_failures_total", 'reason="invalid"') == 2
    assert (
        metric_value(
            response.text, "tandem_router_requests_total", 'endpoint="/v1/models",status="401"'
        )
        == 3
    )


async def test_health_stays_open():
    # The real /health needs the pod pool the lifespan builds, so this app
    # has a stand-in endpoint behind the router's own middleware stack.
    app = FastAPI()
    install_middleware(app, RouterSettings(engines=["fake:1"], api_keys=KEYS), RouterMetrics())

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    c = client(app)
    assert (await c.get("/health")).status_code == 200
    assert_401(await c.get("/v1/models"))
    assert_401(await c.get("/docs"))  # closed by default, not only /v1/*


async def test_no_keys_means_no_auth():
    app = client(create_app(RouterSettings(engines=["fake:1"])))
    response = await app.post("/v1/chat/completions", json={})
    assert response.status_code == 400


def test_keys_file_skips_comments_and_blank_lines(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team A\nkey-one\n\n   # indented comment\n  key-two  \n")
    assert read_keys_file(path) == ["key-one", "key-two"]


def test_keys_file_refuses_trailing_comments_without_echoing(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# ok\nsecret-key # team A\n")
    with pytest.raises(ValueError, match=r"keys:2: a key cannot contain whitespace") as exc:
        read_keys_file(path)
    assert "secret-key" not in str(exc.value)


def test_keys_from_flags_file_and_environment(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    path.write_text("# comment\nfile-key\nflag-a\n")
    monkeypatch.setenv("TANDEM_ROUTER_API_KEYS", "env-a, env-b")
    s = parse_settings(
        [
            "--engine",
            "e:1",
            "--api-key",
            "flag-a",
            "--api-key",
            "flag-b,flag-c",
            "--api-keys-file",
            str(path),
        ]
    )
    assert s.api_keys == ("env-a", "env-b", "flag-a", "flag-b", "flag-c", "file-key")
    assert "flag-a" not in repr(s) and "env-a" not in repr(s)


def test_no_keys_by_default(monkeypatch):
    monkeypatch.delenv("TANDEM_ROUTER_API_KEYS", raising=False)
    monkeypatch.delenv("TANDEM_ROUTER_API_KEYS_FILE", raising=False)
    assert parse_settings(["--engine", "e:1"]).api_keys == ()


def test_missing_keys_file_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit):
        parse_settings(["--engine", "e:1", "--api-keys-file", str(tmp_path / "absent")])


def test_help_never_prints_keys(monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_ROUTER_API_KEYS", "very-secret-key")
    with pytest.raises(SystemExit):
        parse_settings(["--help"])
    out = capsys.readouterr().out
    assert "--api-key" in out and "--max-concurrent-requests" in out
    assert "very-secret-key" not in out
