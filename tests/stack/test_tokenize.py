"""`/tokenize` and `/detokenize` in vLLM's shapes, checked against vLLM's own
server on the same model (same ids for prompts and chats, same text back),
and chats with tools against the router's template rendered by transformers
(vLLM's server has SmolLM2's own template, which ignores tools)."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.helpers import MODEL_NAME, TOOLS_TEMPLATE

pytestmark = pytest.mark.stack

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "The capital of France is", "return_token_strs": True},
        {"prompt": "no specials", "add_special_tokens": False},
        {"messages": CHAT},
        {"messages": CHAT, "add_generation_prompt": False},
    ],
    ids=["prompt", "prompt-plain", "chat", "chat-no-generation-prompt"],
)
def test_tokenize_matches_vllm(stack, reference, body):
    ours = _post(stack.router_url, "/tokenize", {"model": MODEL_NAME, **body})
    assert ours.status_code == 200, ours.text
    theirs = _post(reference, "/tokenize", {"model": MODEL_NAME, **body})
    assert theirs.status_code == 200, theirs.text
    mine, want = ours.json(), theirs.json()
    assert mine["tokens"] == want["tokens"] and mine["count"] == want["count"]
    assert mine["token_strs"] == want.get("token_strs")
    assert mine["max_model_len"] == want["max_model_len"]


def test_tokenize_chat_with_tools(stack, model_dir):
    ours = _post(stack.router_url, "/tokenize", {"messages": CHAT, "tools": TOOLS}).json()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    want = tokenizer.apply_chat_template(
        CHAT,
        tools=TOOLS,
        add_generation_prompt=True,
        chat_template=TOOLS_TEMPLATE.read_text(),
        tokenize=True,
        return_dict=False,
    )
    assert ours["tokens"] == list(want) and ours["count"] == len(want)
    without = _post(stack.router_url, "/tokenize", {"messages": CHAT}).json()
    assert ours["count"] > without["count"]


def test_detokenize_round_trips(stack, reference):
    ids = _post(
        stack.router_url, "/tokenize", {"prompt": "Bonjour, le monde!", "add_special_tokens": False}
    ).json()["tokens"]
    ours = _post(stack.router_url, "/detokenize", {"model": MODEL_NAME, "tokens": ids})
    assert ours.status_code == 200, ours.text
    assert ours.json() == {"prompt": "Bonjour, le monde!"}
    assert (
        ours.json() == _post(reference, "/detokenize", {"model": MODEL_NAME, "tokens": ids}).json()
    )


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ],
)
def test_bad_input_names_the_field(stack, path, body, param):
    response = _post(stack.router_url, path, body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param
