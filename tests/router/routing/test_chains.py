"""Block hashes carried forward per session equal hashing the whole prompt."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.routing.chains import HashChains
from services.router.routing.hashing import BlockHasher

BS = 4
tokens = st.lists(st.integers(0, 5), max_size=40)  # few values: shared blocks are common


def step():
    """What the next request of a conversation does to the previous prompt."""
    return st.tuples(
        st.sampled_from(["extend", "edit", "truncate", "fork", "salt", "other"]),
        st.integers(0, 40),
        tokens,
    )


@settings(max_examples=300, deadline=None)
@given(first=tokens, steps=st.lists(step(), max_size=8))
def test_carried_hashes_equal_full_hashing(first, steps):
    hasher = BlockHasher(BS)
    chains = HashChains(hasher, max_sessions=3, max_tokens=120)  # evictions happen too
    prompt, session, salt = first, "s", None
    forks = 0
    for kind, at, more in [("extend", 0, []), *steps]:
        if kind == "extend":
            prompt = prompt + more
        elif kind == "edit":
            prompt = prompt[:at] + more + prompt[at + 1 :]
        elif kind == "truncate":
            prompt = prompt[:at]
        elif kind == "fork":  # a sub-agent: the parent's context under a new session
            forks += 1
            session, prompt = f"s:sub{forks}", prompt + more
        elif kind == "salt":
            salt = None if salt else "salty"
        else:  # another session in between
            chains.event_hashes(more, "other", None)
        assert chains.event_hashes(prompt, session, salt) == hasher.event_hashes(prompt, salt)


def test_a_turn_hashes_only_its_new_blocks():
    hasher = BlockHasher(BS)
    chains = HashChains(hasher)
    history = list(range(40))  # 10 blocks
    chains.event_hashes(history, "s")
    assert chains.hashed_blocks == 10
    chains.event_hashes(history + [7] * 8, "s")  # 2 new blocks
    assert (chains.hashed_blocks, chains.reused_blocks) == (12, 10)
    chains.event_hashes(history + [7] * 8 + [9] * 4, "sub-agent")  # forks it: 1 new block
    assert (chains.hashed_blocks, chains.reused_blocks) == (13, 22)
    chains.event_hashes(history, "s", cache_salt="x")  # another salt: nothing shared
    assert chains.hashed_blocks == 23


def test_ids_no_tokenizer_gives_are_hashed_in_full():
    hasher = BlockHasher(BS)
    prompt = [-1, 2**40, 3, 4, 5]
    assert HashChains(hasher).event_hashes(prompt, "s") == hasher.event_hashes(prompt)


def test_chains_are_bounded_by_the_tokens_they_hold():
    """Long prompts fill the token bound long before the session bound:
    the least recently used chains go, and their next turn is hashed in full."""
    hasher = BlockHasher(BS)
    chains = HashChains(hasher, max_sessions=100, max_tokens=100)
    for i in range(5):
        chains.event_hashes([i] * 40, f"s{i}")  # 40 tokens each
    assert len(chains) == 2 and chains.tokens == 80 and chains.evictions == 3
    hashed = chains.hashed_blocks
    chains.event_hashes([0] * 40 + [1] * 4, "s0")  # forgotten: all 11 blocks hashed again
    assert chains.hashed_blocks == hashed + 11
    chains.event_hashes([4] * 40 + [1] * 4, "s4")  # kept: 1 new block
    assert chains.hashed_blocks == hashed + 12
    assert chains.tokens <= 100
