"""A real agent loop through the router: a LangGraph graph with LangChain's
OpenAI chat model and ToolNode, two tools (a file lookup and a calculator),
several turns on the P/D stack. SmolLM2-135M cannot pick tools well, so each
tool turn forces its tool (structured output makes the arguments valid);
the tools really run, their results go back as tool messages, and the later
turns of the conversation are prefix-cache hits."""

from __future__ import annotations

import httpx
import jsonschema
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from pydantic import BaseModel, Field

from tests.helpers import MODEL_NAME, metric_value

pytestmark = pytest.mark.stack

FILES = {"inventory.txt": "apples: 12\npears: 30"}


class LookupArgs(BaseModel):
    filename: str = Field(max_length=30, description="the file's name")


@tool(args_schema=LookupArgs)
def lookup(filename: str) -> str:
    """Read a file of the shared drive by name."""
    return FILES.get(filename, f"no file named {filename}")


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


TOOLS = [lookup, add]
PLAN = ["lookup", "add", "none"]  # the tool each model turn must call ("none": answer)


def _graph(stack):
    model = ChatOpenAI(
        model=MODEL_NAME,
        base_url=f"{stack.router_url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=60,
        max_retries=0,
    )
    turns: list[AIMessage] = []
    ttfts: list[float] = []  # as the router measured each turn's first token

    def ttft_totals() -> tuple[float, float]:
        text = httpx.get(f"{stack.router_url}/metrics", timeout=10).text
        return (
            metric_value(text, "tandem_router_ttft_seconds_sum"),
            metric_value(text, "tandem_router_ttft_seconds_count"),
        )

    def agent(state: MessagesState) -> dict:
        choice = PLAN[len(turns)]
        bound = model.bind_tools(TOOLS, tool_choice=choice)
        before = ttft_totals()
        reply = bound.invoke(state["messages"])
        after = ttft_totals()
        ttfts.append((after[0] - before[0]) / max(1.0, after[1] - before[1]))
        turns.append(reply)
        return {"messages": [reply]}

    def route(state: MessagesState) -> str:
        return "tools" if state["messages"][-1].tool_calls else END

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(TOOLS))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", route, ["tools", END])
    graph.add_edge("tools", "agent")
    return graph.compile(), turns, ttfts


def test_agent_runs_tools_over_several_turns(stack):
    app, turns, ttfts = _graph(stack)
    final = app.invoke(
        {"messages": [HumanMessage("How many apples and pears are in inventory.txt, together?")]},
        {"recursion_limit": 10},
    )
    messages = final["messages"]
    assert len(turns) == 3 and turns[-1].content and not turns[-1].tool_calls
    schemas = {t.name: t.args_schema.model_json_schema() for t in TOOLS}
    for turn, name in zip(turns[:2], PLAN[:2], strict=True):
        (call,) = turn.tool_calls
        assert call["name"] == name
        jsonschema.validate(call["args"], schemas[name])
    results = [m for m in messages if isinstance(m, ToolMessage)]
    assert [r.name for r in results] == ["lookup", "add"]
    assert all(r.status == "success" for r in results)
    # The tools ran on the model's arguments.
    assert results[0].content == lookup.invoke(turns[0].tool_calls[0]["args"])
    assert results[1].content == str(add.invoke(turns[1].tool_calls[0]["args"]))
    # Each later turn extends the conversation: its prompt hits the cache.
    usage = [t.response_metadata["token_usage"] for t in turns]
    prompts = [u["prompt_tokens"] for u in usage]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
    assert prompts == sorted(prompts) and all(c > 0 for c in cached[1:])
    print(
        "agent loop: prompt tokens",
        prompts,
        "cached",
        cached,
        "TTFT s",
        [round(t, 3) for t in ttfts],
    )
