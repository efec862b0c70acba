"""What real clients send that is odd, thrown at the real router process
(tests/router/fuzz_helpers.py; no mocks but the engine): content-part arrays,
image parts on a text model, ``null`` fields, NUL bytes, lone surrogates (as
JSON ``\\ud800`` escapes), very many messages, huge ``max_tokens``, ``n``
with tools, non-UTF-8 bodies, invalid JSON, deep nesting, a 50 MB body and
a slow-loris upload.

Every answer: no 5xx, no hang (every call has a client timeout), the router
still alive after, every 4xx in the endpoint's own error format (OpenAI's;
Anthropic's on /v1/messages), and a 400 caused by one field names it
(OpenAI's ``param``, the ``<field>: `` that starts Anthropic's message)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.router_fakes import MODEL_NAME
from tests.router.fuzz_helpers import LiveRouter, check_answer, named_field

pytestmark = pytest.mark.timeout(600)
# A few examples in the unit suite; `make fuzz` runs many (TANDEM_FUZZ_EXAMPLES).
EXAMPLES = settings(
    max_examples=int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
JSON = {"content-type": "application/json"}
HI = [{"role": "user", "content": "hi"}]

# A valid body of each endpoint: each example makes one of its fields odd.
BASES: dict[str, dict] = {
    "/v1/chat/completions": {"model": MODEL_NAME, "messages": HI, "max_tokens": 2},
    "/v1/completions": {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
    "/v1/messages": {"model": MODEL_NAME, "messages": HI, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": MODEL_NAME, "messages": HI},
    "/v1/responses": {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2},
    "/tokenize": {"messages": HI},
    "/detokenize": {"tokens": [1, 2]},
}
# The fields made odd, by endpoint: ("a", "b", 0) is body["a"]["b"][0].
FIELDS: dict[str, list[tuple]] = {
    "/v1/chat/completions": [
        ("messages",),
        ("messages", 0),
        ("messages", 0, "content"),
        ("messages", 0, "role"),
        ("model",),
        ("max_tokens",),
        ("n",),
        ("stop",),
        ("seed",),
        ("temperature",),
        ("tools",),
        ("tool_choice",),
        ("response_format",),
        ("user",),
        ("stream",),
        ("logprobs",),
    ],
    "/v1/completions": [("prompt",), ("max_tokens",), ("n",), ("stop",), ("logprobs",)],
    "/v1/messages": [
        ("messages",),
        ("messages", 0, "content"),
        ("system",),
        ("max_tokens",),
        ("stop_sequences",),
        ("tools",),
        ("tool_choice",),
        ("metadata",),
        ("thinking",),
    ],
    "/v1/messages/count_tokens": [("messages", 0, "content"), ("system",), ("tools",)],
    "/v1/responses": [
        ("input",),
        ("instructions",),
        ("max_output_tokens",),
        ("tools",),
        ("tool_choice",),
        ("text",),
        ("previous_response_id",),
    ],
    "/tokenize": [("messages", 0, "content"), ("prompt",), ("tools",)],
    "/detokenize": [("tokens",), ("tokens", 0)],
}

# Text as clients mangle it: NUL bytes, lone surrogates (sent as JSON
# escapes), byte-order marks, control and private-use characters.
ODD_TEXT = st.sampled_from(
    ["", "\x00", "a\x00b", "\ud800", "x\udfffy", "\ufeff", "\u202e", "\U0001f600", "\r\n"]
) | st.text(st.characters(categories=["Cs", "Cc", "Co", "Zs", "Lo"]), max_size=8)
# Content-part arrays: text parts, parts that are not text (an image on a
# text model, audio, a file), parts missing their text or typed oddly.
PART = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, ODD_TEXT),
    st.just({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}),
    st.just({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}),
    st.just({"type": "input_image", "image_url": "https://example.com/cat.png"}),
    st.just({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}),
    st.just({"type": "text"}),
    st.just({"type": "text", "text": None}),
    st.just({"text": "no type"}),
    st.just({"type": None}),
)
PARTS = st.lists(PART, max_size=4)
ODD_NUMBERS = st.sampled_from(
    [0, -1, 2**31, 2**32, 2**63, 2**64, 10**30, -(10**30), 1e308, -0.0, 2.5, True]
)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
ODD_VALUES = st.one_of(
    st.none(),
    ODD_TEXT,
    PARTS,
    ODD_NUMBERS,
    st.builds(lambda n: [{"role": "user", "content": "hi"}] * n, st.integers(0, 3000)),
    st.builds(lambda n: f"__DEEP_{n}__", st.sampled_from([64, 999, 1001, 10_000])),
    st.just([TOOL] * 3),
    st.just({}),
    st.just([]),
)


def encoded(body: object) -> bytes:
    """The JSON of `body`, lone surrogates as escapes (as JavaScript clients
    send them), ``__DEEP_n__`` as n nested arrays."""
    text = json.dumps(body, ensure_ascii=True)
    while "__DEEP_" in text:
        start = text.index('"__DEEP_')
        end = text.index('__"', start) + 3
        depth = int(text[start + 8 : end - 3])
        text = text[:start] + "[" * depth + "]" * depth + text[end:]
    return text.encode()


def with_field(body: dict, path: tuple, value: object) -> dict:
    body = json.loads(json.dumps(body))
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


def message(path: str, response: httpx.Response) -> str:
    error = response.json()["error"]
    return error["message"]


def post(router: LiveRouter, path: str, content: bytes, **kw) -> httpx.Response:
    response = router.client.post(path, content=content, headers=JSON, timeout=30, **kw)
    check_answer(path, response, content[:300])
    return response


@st.composite
def odd_requests(draw):
    path = draw(st.sampled_from(sorted(BASES)))
    field = draw(st.sampled_from(FIELDS[path]))
    value = draw(ODD_VALUES)
    return path, field, with_field(BASES[path], field, value)


@EXAMPLES
@given(odd_requests())
def test_one_odd_field_is_answered_and_named(fuzz_router, request_):
    path, field, body = request_
    try:
        response = post(fuzz_router, path, encoded(body))
    except httpx.TimeoutException:
        raise AssertionError(f"no answer: {path} {encoded(body)[:500]!r}") from None
    if response.status_code == 400 and not message(path, response).startswith("request body"):
        named = named_field(path, response)
        assert named is not None, f"{path} {field}: {response.text}"
        assert named.split(".")[0].split("[")[0] == field[0], f"{path} {field}: {response.text}"
    assert fuzz_router.proc.alive()


@EXAMPLES
@given(
    st.lists(st.sampled_from(["stream", "n", "tools", "tool_choice", "logprobs"]), max_size=3),
    st.integers(1, 16),
)
def test_n_with_tools(fuzz_router, extras, n):
    """`n` > 1 with tools, tool choices and streaming, on chat."""
    body = dict(BASES["/v1/chat/completions"], n=n, tools=[TOOL])
    for extra in extras:
        body[extra] = {
            "stream": True,
            "n": 16,
            "tools": [TOOL, TOOL],
            "tool_choice": "required",
            "logprobs": True,
        }[extra]
    response = post(fuzz_router, "/v1/chat/completions", encoded(body))
    if response.status_code == 200 and not body.get("stream"):
        assert len(response.json()["choices"]) == body["n"]


ALL_PATHS = sorted(BASES)


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize(
    "content",
    [
        b'{"model": "\xff\xfe", "prompt": "\xc3\x28"}',  # not UTF-8
        b'{"model": ',  # truncated
        b"",
        b"[1, 2]",
        b"null",
        b'{"a": NaN}',
        b"[" * 10_000 + b"]" * 10_000,
        b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
    ],
    ids=["non-utf8", "truncated", "empty", "array", "null", "nan", "deep", "deep-field"],
)
def test_bodies_that_are_not_json_objects_are_400(fuzz_router, path, content):
    response = post(fuzz_router, path, content)
    assert response.status_code == 400, response.text
    assert "There was an error" not in message(path, response)


@pytest.mark.parametrize(
    "path, body, field",
    [
        (
            "/v1/chat/completions",
            with_field(BASES["/v1/chat/completions"], ("user",), "\ud800"),
            "user",
        ),
        (
            "/v1/chat/completions",
            with_field(BASES["/v1/chat/completions"], ("stop",), ["\udc00"]),
            "stop[0]",
        ),
        (
            "/v1/chat/completions",
            with_field(BASES["/v1/chat/completions"], ("model",), "\ud800"),
            "model",
        ),
        (
            "/v1/chat/completions",
            with_field(BASES["/v1/chat/completions"], ("messages", 0, "content"), "a\ud800"),
            "messages[0].content",
        ),
        ("/v1/completions", with_field(BASES["/v1/completions"], ("prompt",), "\udfff"), "prompt"),
        (
            "/v1/messages",
            with_field(BASES["/v1/messages"], ("messages", 0, "content"), "\ud800"),
            "messages[0].content",
        ),
        (
            "/v1/messages/count_tokens",
            with_field(BASES["/v1/messages/count_tokens"], ("system",), "\ud800"),
            "system",
        ),
        ("/v1/responses", with_field(BASES["/v1/responses"], ("input",), "\ud800"), "input"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(fuzz_router, path, body, field):
    """Found by this suite: a lone surrogate reached the tokenizer (TypeError),
    gRPC or the session hash (UnicodeEncodeError): 500s that dropped the
    client's keep-alive connection."""
    response = post(fuzz_router, path, encoded(body))
    assert response.status_code == 400, response.text
    assert named_field(path, response) == field, response.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_an_image_part_on_a_text_model_names_the_part(fuzz_router, path):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    body = with_field(
        BASES[path], ("messages", 0, "content"), [{"type": "text", "text": "hi"}, image]
    )
    response = post(fuzz_router, path, encoded(body))
    assert response.status_code == 400, response.text
    assert named_field(path, response) == "messages[0].content[1]", response.text


def test_tokenize_checks_tool_calls_as_chat_does(fuzz_router):
    """Found by Schemathesis: /tokenize rendered an assistant tool call
    without a function, and the chat template failed (500 UndefinedError)."""
    calls = [{"id": "call_1", "type": "function"}]
    body = {"messages": [{"role": "assistant", "tool_calls": calls}, {"role": "developer"}]}
    response = post(fuzz_router, "/tokenize", encoded(body))
    assert response.status_code == 400, response.text
    assert named_field("/tokenize", response) == "messages[0].tool_calls[0].function.name"


def test_huge_max_tokens_is_400_naming_it(fuzz_router):
    for value in (2**32 - 1, 2**32, 10**30):
        body = with_field(BASES["/v1/chat/completions"], ("max_tokens",), value)
        response = post(fuzz_router, "/v1/chat/completions", encoded(body))
        assert response.status_code == 400 and named_field("", response) == "max_tokens"


def test_responses_name_their_own_fields_when_the_chat_path_refuses(fuzz_router):
    """Found by this suite: a Responses request beyond the context was
    refused naming chat's `max_tokens`."""
    body = with_field(BASES["/v1/responses"], ("max_output_tokens",), 2**31)
    response = post(fuzz_router, "/v1/responses", encoded(body))
    assert response.status_code == 400 and named_field("", response) == "max_output_tokens"
    body = with_field(BASES["/v1/responses"], ("input",), "hi " * 10_000)
    response = post(fuzz_router, "/v1/responses", encoded(body))
    assert response.status_code == 400 and named_field("", response) == "input", response.text


def test_very_many_messages_are_answered(fuzz_router):
    body = with_field(BASES["/v1/chat/completions"], ("messages",), HI * 20_000)
    response = post(fuzz_router, "/v1/chat/completions", encoded(body))
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


FIFTY_MB = 50 * 1024 * 1024


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/tokenize"])
def test_a_50mb_body_is_413_in_the_api_format(fuzz_router, path):
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * FIFTY_MB + b'"}]}'
    response = post(fuzz_router, path, body)
    assert response.status_code == 413, response.text


def test_a_50mb_chunked_body_is_refused_without_buffering_it(fuzz_router):
    """No Content-Length: the router reads up to its limit (16 MiB), not the
    50 MB; its peak memory grows by less than the body."""
    before = fuzz_router.rss_peak_kib()

    def chunks():
        for _ in range(50):
            yield b"a" * (1024 * 1024)

    response = fuzz_router.client.post("/v1/chat/completions", content=chunks(), headers=JSON)
    check_answer("/v1/chat/completions", response)
    assert response.status_code == 413
    grown_mib = (fuzz_router.rss_peak_kib() - before) / 1024
    assert grown_mib < 40, f"peak RSS grew by {grown_mib:.0f} MiB for a 50 MB body"


def _complete(answer: bytes) -> bool:
    """Whether `answer` holds a whole HTTP response (head and body)."""
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return True


def _slow_upload(url: str, path: str, seconds: float) -> tuple[float, bytes]:
    """Announce a 1000-byte body and send it a byte a second; return when the
    router answers (or after `seconds`) and what it answered."""
    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n{".encode()
        )
        sock.settimeout(1.0)
        answer = b""
        while time.monotonic() - start < seconds and not _complete(answer):
            try:
                if not answer:  # still uploading, a byte a second
                    sock.sendall(b" ")
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
            except TimeoutError:
                continue
            except OSError:
                break
    return time.monotonic() - start, answer


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_slow_loris_upload_times_out_and_holds_no_slot(fuzz_router, path):
    """Body timeout 2 s (the fixture's --body-timeout-s): the upload gets 408
    in the API's format, and meanwhile a normal request is served."""
    result: dict = {}
    thread = threading.Thread(
        target=lambda: result.update(answer=_slow_upload(fuzz_router.url, path, 15))
    )
    thread.start()
    time.sleep(0.3)
    served = post(fuzz_router, "/v1/chat/completions", encoded(BASES["/v1/chat/completions"]))
    assert served.status_code == 200
    thread.join(20)
    elapsed, answer = result["answer"]
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert elapsed < 10, f"answered after {elapsed:.1f}s"
    head, _, body = answer.partition(b"\r\n\r\n")
    error = json.loads(body)
    assert (error["type"] == "error") if path == "/v1/messages" else ("error" in error), error
    assert fuzz_router.client.get("/health").status_code == 200
