"""`python -m tandem.smoke`: send one chat completion through a Tandem router and check it.

This is what `helm test` runs against a fresh install (helm/tandem/templates/
tests/), and what anyone can run against a router: it waits for the router's
/health, asks /v1/models for the model when none is given, sends one greedy
chat completion and exits 0 when the reply is a well-formed, non-empty
completion; otherwise it prints why and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import httpx


def reply_problems(status: int, body: object) -> list[str]:
    """What is wrong with a chat completion response (pure); empty when it is good."""
    if status != 200:
        return [f"HTTP {status}: {json.dumps(body)[:500]}"]
    if not isinstance(body, dict):
        return [f"the body is not a JSON object: {str(body)[:200]}"]
    out = []
    if body.get("object") != "chat.completion":
        out.append(f"object is {body.get('object')!r}, not 'chat.completion'")
    choices = body.get("choices") or []
    if len(choices) != 1:
        out.append(f"{len(choices)} choices, expected 1")
    else:
        message = choices[0].get("message") or {}
        if not (message.get("content") or "").strip():
            out.append("the reply's content is empty")
        if choices[0].get("finish_reason") not in ("stop", "length"):
            out.append(f"finish_reason is {choices[0].get('finish_reason')!r}")
    usage = body.get("usage") or {}
    if not usage.get("prompt_tokens") or not usage.get("completion_tokens"):
        out.append(f"usage lacks token counts: {usage}")
    return out


def wait_healthy(client: httpx.Client, deadline: float) -> None:
    while True:
        try:
            if client.get("/health").status_code == 200:
                return
            reason = "not healthy yet"
        except httpx.HTTPError as exc:
            reason = str(exc)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router at {client.base_url} did not become healthy: {reason}")
        time.sleep(2)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tandem.smoke",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--url",
        default=os.environ.get("TANDEM_URL", "http://127.0.0.1:8000"),
        help="the router's base URL (default: $TANDEM_URL or %(default)s)",
    )
    parser.add_argument(
        "--model", default="", help="the model to ask (default: the first /v1/models lists)"
    )
    parser.add_argument("--prompt", default="What is the capital of France? Answer in one word.")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=300.0,
        help="seconds to wait for the router to be healthy and answer",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY", ""),
        help="API key to send ($TANDEM_API_KEY; a comma-separated list uses its first key)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    key = args.api_key.split(",")[0].strip()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + args.timeout_s
    with httpx.Client(base_url=args.url, headers=headers, timeout=args.timeout_s) as client:
        try:
            wait_healthy(client, deadline)
            model = args.model
            if not model:
                listed = client.get("/v1/models")
                listed.raise_for_status()
                model = listed.json()["data"][0]["id"]
            response = client.post(
                "/v1/chat/completions",
                json={
                    "model": model,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": args.prompt}],
                },
            )
        except (httpx.HTTPError, TimeoutError, KeyError, IndexError, ValueError) as exc:
            print(f"FAIL: {exc}", file=sys.stderr)
            return 1
    try:
        body = response.json()
    except ValueError:
        body = response.text
    problems = reply_problems(response.status_code, body)
    if problems:
        print("FAIL: " + "; ".join(problems), file=sys.stderr)
        return 1
    print(
        f"OK: {model} answered {body['choices'][0]['message']['content']!r} "
        f"({body['usage']['completion_tokens']} tokens)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
