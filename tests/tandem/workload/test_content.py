"""Synthetic prompts reproduce a trace's block-hash structure token-exactly with
the real model tokenizer and chat template (the same calls vLLM makes):
identical hash ids => identical token blocks, different => different.
No mocks, no server; needs the default model folder (prepared by `make setup`)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from common.model import resolve_model
from tandem.workload.content import PromptBuilder, scope_key
from tandem.workload.generate import generate, params_for


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(resolve_model(None)))


@pytest.fixture(scope="module")
def builder(tok):
    return PromptBuilder(tok, salt="test")


def _engine_tokens(tok, messages):
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def _blocks(ids, n_in, bs):
    """The trace's blocks: the first ``in`` rendered tokens cut every ``bs``."""
    ids = ids[:n_in]
    return [tuple(ids[i : i + bs]) for i in range(0, n_in, bs)]


def test_prompt_length_and_engine_tokens(tok, builder):
    p = builder.build("", [1, 2, 3, 4], 200, 64)
    assert _engine_tokens(tok, p.messages) == p.token_ids
    assert p.expected_prompt_tokens == 200 + len(builder.suffix)
    assert p.token_ids[: len(builder.header)] == builder.header


@pytest.mark.parametrize("bs", [32, 64, 128])
def test_identical_ids_identical_blocks_different_ids_different(tok, builder, bs):
    # a: [1..6], b shares the first 4 ids then diverges, c shares only id 1
    a_ids, b_ids, c_ids = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 90, 91, 92], [1, 70, 3, 4]
    a_in, b_in, c_in = 6 * bs - 5, 7 * bs, 4 * bs - 1
    a = _engine_tokens(tok, builder.build("", a_ids, a_in, bs).messages)
    b = _engine_tokens(tok, builder.build("", b_ids, b_in, bs).messages)
    c = _engine_tokens(tok, builder.build("", c_ids, c_in, bs).messages)
    A, B, C = _blocks(a, a_in, bs), _blocks(b, b_in, bs), _blocks(c, c_in, bs)
    for X, X_ids, Y, Y_ids in ((A, a_ids, B, b_ids), (A, a_ids, C, c_ids), (B, b_ids, C, c_ids)):
        for i in range(min(len(X), len(Y))):
            full = len(X[i]) == bs and len(Y[i]) == bs
            if X_ids[i] == Y_ids[i] and full:
                assert X[i] == Y[i], f"block {i}: same id, different tokens"
            if X_ids[i] != Y_ids[i]:
                assert X[i] != Y[i], f"block {i}: different ids, same tokens"
    # the shared prefix is exactly the shared blocks: the first difference
    # between a and b falls inside block 4 (same position in the rendered ids)
    first_diff = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert 4 * bs <= first_diff < 5 * bs


def test_partial_last_block_is_a_prefix_of_the_full_block(tok, builder):
    bs = 64
    short = builder.build("", [1, 2, 3], 2 * bs + 10, bs).token_ids
    longer = builder.build("", [1, 2, 3, 4], 3 * bs + 5, bs).token_ids
    assert short[: 2 * bs + 10] == longer[: 2 * bs + 10]


def test_scope_and_salt(tok, builder):
    bs = 64
    g1 = builder.build(scope_key("s1", "global"), [1, 2], 2 * bs, bs).token_ids
    g2 = builder.build(scope_key("s2", "global"), [1, 2], 2 * bs, bs).token_ids
    l1 = builder.build(scope_key("s1", "local"), [1, 2], 2 * bs, bs).token_ids
    l2 = builder.build(scope_key("s2", "local"), [1, 2], 2 * bs, bs).token_ids
    assert g1 == g2  # global ids are shared across sessions
    assert l1[:bs] != l2[:bs]  # local ids are private to a session
    other = PromptBuilder(tok, salt="another").build("", [1, 2], 2 * bs, bs).token_ids
    assert other[len(builder.header) : bs] != g1[len(builder.header) : bs]


def test_every_generated_request_verifies(tok):
    # verify=True re-renders and re-tokenizes every prompt and raises on mismatch
    b = PromptBuilder(tok, salt="gen", verify=True)
    sessions = generate(params_for("small", sessions=3, seed=9))
    n = 0
    for s in sessions:
        for _, _, r in s.iter_requests():
            p = b.build(scope_key(s.id, s.hash_id_scope), r.hash_ids, r.in_tokens, s.block_size)
            assert len(p.token_ids) == r.in_tokens + len(b.suffix)
            n += 1
    assert n > 20


def test_block_size_smaller_than_header_is_refused(builder):
    with pytest.raises(ValueError, match="must exceed the chat template header"):
        builder.build("", [1], 10, 16)
