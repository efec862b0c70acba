"""Session identity and incremental tokenization, with the real model tokenizer (no mocks)."""

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from common.model import resolve_model
from services.router.chat_templates import CHATML_TOOLS
from services.router.routing.sessions import (
    IncrementalTokenizer,
    backend_encoder,
    common_prefix_len,
    session_key,
)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_model(None))


def test_identity_header_then_user_then_derived():
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    assert session_key({"X-Session-Id": "abc"}, {"user": "u", "messages": msgs}).key == "h:abc"
    assert session_key({}, {"user": "u", "messages": msgs}).source == "user"
    assert session_key({"x-agent": "z"}, {"messages": msgs}, header_name="X-Agent").key == "h:z"
    derived = session_key({}, {"messages": msgs})
    assert derived.source == "derived"
    # later turns of the same conversation keep the key
    longer = msgs + [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    assert session_key({}, {"messages": longer}).key == derived.key
    other = [{"role": "system", "content": "sys"}, {"role": "user", "content": "other task"}]
    assert session_key({}, {"messages": other}).key != derived.key
    assert session_key({}, {"prompt": "abc"}).source == "derived"
    assert session_key({}, {}) is None


def conversation(turns):
    msgs = [{"role": "system", "content": "You are a coding agent.  Tools: grep, edit."}]
    for t in range(turns):
        msgs.append(
            {"role": "user", "content": f"Step {t}: run `grep -n foo{t}`\n\n  and fix it. "}
        )
        msgs.append({"role": "assistant", "content": f"<tool>grep foo{t}</tool>\nDone {t}.  "})
    return msgs


def test_incremental_equals_full_tokenization(tok):
    inc = IncrementalTokenizer(tok)
    for turns in range(1, 8):
        msgs = conversation(turns)[:-1]  # ends with the user's turn
        text = inc.render_chat(msgs)
        assert inc.encode(text, "s1") == tok(text, add_special_tokens=False)["input_ids"]
    assert inc.stats.incremental == 6 and inc.stats.full == 1
    assert inc.stats.reused_tokens > 0


def test_edited_history_still_equals_full(tok):
    inc = IncrementalTokenizer(tok)
    msgs = conversation(3)[:-1]
    inc.encode(inc.render_chat(msgs), "s")
    msgs[1]["content"] = "Edited first step"  # the client rewrote history
    text = inc.render_chat(msgs)
    assert inc.encode(text, "s") == tok(text, add_special_tokens=False)["input_ids"]
    # unrelated text for the session: falls back to full tokenization
    assert (
        inc.encode("no special tokens here", "s")
        == tok("no special tokens here", add_special_tokens=False)["input_ids"]
    )


def test_tokenizes_only_the_new_suffix(tok):
    inc = IncrementalTokenizer(tok)
    msgs = conversation(20)[:-1]
    first = inc.render_chat(msgs)
    inc.encode(first, "s")
    chars_before = inc.stats.tokenized_chars
    msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    second = inc.render_chat(msgs)
    assert inc.encode(second, "s") == tok(second, add_special_tokens=False)["input_ids"]
    tokenized = inc.stats.tokenized_chars - chars_before
    assert tokenized < 100 < len(second)  # only the tail, not the 20-turn history


def test_session_memory_is_bounded(tok):
    inc = IncrementalTokenizer(tok, max_sessions=2)
    for s in "abc":
        inc.encode(inc.render_chat(conversation(1)), s)
    assert list(inc._sessions) == ["b", "c"]


def test_common_prefix_len_matches_commonprefix():
    rng = random.Random(7)
    base = "".join(rng.choice("ab<|>\n é") for _ in range(300))
    cases = [
        ("", ""),
        ("", "x"),
        ("abc", "abc"),
        ("abc", "abd"),
        ("ab", "abc"),
        (base, base),
        (base, base + "tail"),
    ]
    for _ in range(200):
        cut = rng.randrange(len(base) + 1)
        cases.append((base, base[:cut] + rng.choice("xyz") + base[cut:]))
        cases.append((base[:cut], base))
    for a, b in cases:
        want = len(os.path.commonprefix([a, b]))
        assert common_prefix_len(a, b) == want == common_prefix_len(b, a)


@pytest.mark.parametrize(
    "text",
    [
        "plain words",
        "  leading and trailing spaces  ",
        "<|im_start|>user\nhi<|im_end|>\n",
        "<|im_start|>assistant\n  \n\n<|im_end|><|endoftext|>",
        "unicode: é ü 汉字 🤖",
        "x" * 5000,
        "code:\n\tdef f(x):\n\t\treturn x  # <|im_end|> inside",
    ],
)
def test_backend_encoder_equals_the_tokenizer(tok, text):
    enc = backend_encoder(tok)
    for special in (False, True):
        ours = enc.encode(text, add_special_tokens=special)
        theirs = tok(text, add_special_tokens=special, return_offsets_mapping=True)
        assert ours.ids == theirs["input_ids"]
        assert ours.offsets == [tuple(o) for o in theirs["offset_mapping"]]


def test_the_token_bound_forgets_old_sessions_and_results_stay_exact(tok):
    inc = IncrementalTokenizer(tok, max_sessions=10, max_tokens=1)  # any session is over it
    text = inc.render_chat(conversation(2))
    for s in "abc":
        assert inc.encode(text, s) == tok(text, add_special_tokens=False)["input_ids"]
    # Only the newest is kept, alone over the bound; the others were evicted.
    assert list(inc._sessions) == ["c"] and inc.evictions == 2
    assert inc.cached_tokens == len(tok(text, add_special_tokens=False)["input_ids"])
    longer = inc.render_chat(conversation(3))
    reused = inc.stats.reused_tokens
    assert inc.encode(longer, "c") == tok(longer, add_special_tokens=False)["input_ids"]
    assert inc.stats.reused_tokens > reused  # the kept one still extends incrementally
    # Evicted: found again by its opening (the kept session begins alike),
    # exactly; only the very first text was tokenized in full.
    assert inc.encode(longer, "a") == tok(longer, add_special_tokens=False)["input_ids"]
    assert inc.stats.full == 1
    with pytest.raises(ValueError):
        IncrementalTokenizer(tok, max_tokens=0)


def test_a_sub_agent_reuses_its_parents_tokens(tok):
    inc = IncrementalTokenizer(tok)
    msgs = conversation(20)[:-1]
    inc.encode(inc.render_chat(msgs), "parent")
    chars_before = inc.stats.tokenized_chars
    fork = inc.render_chat(
        msgs
        + [{"role": "assistant", "content": "ok"}]
        + [{"role": "user", "content": "Sub-task: read the tests"}]
    )
    assert inc.encode(fork, "parent:sub0") == tok(fork, add_special_tokens=False)["input_ids"]
    assert inc.stats.tokenized_chars - chars_before < 100  # the fork's own tail only


AGENT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
_words = st.lists(
    st.sampled_from([*'ab <>|_\n\t{}"é汉🤖', "<|im_end|>", "<|im_start|>"]), max_size=20
).map("".join)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"]), "content": _words}
)
_step = st.tuples(
    st.sampled_from(["turn", "fork", "edit", "other"]), st.lists(_message, max_size=3)
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(system=_words, steps=st.lists(_step, min_size=1, max_size=6), tools=st.booleans())
def test_sessions_and_forks_equal_full_tokenization_property(tok, system, steps, tools):
    """Any sequence of turns, forks, edited histories and other sessions, over
    the model's template and the tool template with tools: each result
    equals tokenizing the whole rendered text."""
    inc = IncrementalTokenizer(tok)
    kwargs = {"tools": AGENT_TOOLS, "chat_template": CHATML_TOOLS.read_text()} if tools else {}
    msgs = [{"role": "system", "content": system}]
    session, forks = "s", 0
    for kind, more in steps:
        if kind == "edit" and len(msgs) > 1:
            msgs = [msgs[0], {"role": "user", "content": "edited"}, *msgs[2:]]
        elif kind == "fork":
            forks += 1
            session = f"s:sub{forks}"
        elif kind == "other":
            other = inc.render_chat([{"role": "user", "content": system + "x"}], **kwargs)
            inc.encode(other, "other")
        msgs = msgs + more + [{"role": "user", "content": "go"}]
        text = inc.render_chat(msgs, **kwargs)
        assert inc.encode(text, session) == tok(text, add_special_tokens=False)["input_ids"]
