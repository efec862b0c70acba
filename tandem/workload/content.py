"""Chat prompts whose tokens reproduce a trace's block-hash structure exactly.

A request with ``in`` tokens and hash ids ``h0 .. h(n-1)`` becomes one chat
request with a single user message. Rendered with the model's chat template and
tokenized the way vLLM does it (``apply_chat_template(..., tokenize=False)`` then
``tokenizer(text, add_special_tokens=False)``), its token ids are::

    [template header][filler ........................][template suffix]
    |<------------------- in tokens ---------------->|<-- S tokens -->|

and the first ``in`` tokens, cut into blocks of ``block_size``, hold in block
``i`` a token sequence that is a function of ``hash_ids[i]`` alone (block 0
starts with the constant template header). So requests that share hash ids
share exactly those token blocks, and a prefix cache sees exactly the reuse the
trace describes. The prompt has ``in + S`` tokens (S = 6 for SmolLM2: the
template's ``<|im_end|>`` and assistant header), reported as ``prompt_tokens``.

Filler tokens are words that are one token each and stay one token in any
sequence (`` word`` with a leading space under byte-level BPE), drawn by a
generator seeded from (salt, scope, hash id): the same id always yields the same
stream, so a partial last block is a prefix of the full block with the same id.
The salt makes each run's content new (a cold cache) without changing structure.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

_MARK = "\u2063MARK\u2063"


@dataclass(frozen=True)
class BuiltPrompt:
    messages: list[dict[str, str]]
    token_ids: list[int]  # exactly what the engine will see
    expected_prompt_tokens: int


class PromptBuilder:
    """Builds and verifies prompts for one tokenizer."""

    def __init__(self, tokenizer: Any, salt: str = "", verify: bool = True):
        self.tok = tokenizer
        self.salt = salt
        self.verify = verify
        self.words = self._single_token_words()
        if len(self.words) < 256:
            raise RuntimeError(
                f"tokenizer has only {len(self.words)} single-token words; "
                f"cannot build block-exact filler"
            )
        self.header, self.suffix = self._template_frame()
        self._blocks: dict[tuple, np.ndarray] = {}

    @classmethod
    def from_model(cls, model_dir: str, salt: str = "", verify: bool = True) -> PromptBuilder:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_dir)), salt=salt, verify=verify)

    # -- set-up
    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _single_token_words(self) -> np.ndarray:
        vocab = self.tok.get_vocab()
        ids = []
        for piece, idx in vocab.items():
            # byte-level BPE marks a leading space with "Ġ"; sentencepiece with "▁"
            m = re.fullmatch(r"[Ġ▁]([a-z]{3,12})", piece)
            if m and self._encode(" " + m.group(1)) == [idx]:
                ids.append(idx)
        return np.array(sorted(ids), dtype=np.int64)

    def _template_frame(self) -> tuple[list[int], list[int]]:
        text = self.tok.apply_chat_template(
            [{"role": "user", "content": _MARK}], add_generation_prompt=True, tokenize=False
        )
        if text.count(_MARK) != 1:
            raise RuntimeError("chat template does not place the user content verbatim")
        head, tail = text.split(_MARK)
        return self._encode(head), self._encode(tail)

    def check_block_size(self, block_size: int) -> None:
        if block_size <= len(self.header):
            raise ValueError(
                f"block_size {block_size} must exceed the chat template "
                f"header ({len(self.header)} tokens) of this tokenizer"
            )

    # -- blocks
    def _block(self, scope: str, h: int, n: int) -> np.ndarray:
        key = (scope, h)
        blk = self._blocks.get(key)
        if blk is None or len(blk) < n:
            digest = hashlib.blake2b(f"{self.salt}\0{scope}\0{h}".encode(), digest_size=8).digest()
            rng = np.random.default_rng(int.from_bytes(digest, "big"))
            blk = self.words[rng.integers(0, len(self.words), size=max(n, 1))]
            self._blocks[key] = blk
        return blk[:n]

    def content_ids(self, scope: str, hash_ids: list[int], n_in: int, block_size: int) -> list[int]:
        """The filler token ids (everything between header and suffix)."""
        self.check_block_size(block_size)
        hdr = len(self.header)
        n_in = max(n_in, hdr + 1)
        parts = []
        for i, h in enumerate(hash_ids):
            start = i * block_size
            end = min(n_in, start + block_size)
            if end <= start:
                break
            lo = max(start, hdr)  # block 0 begins with the header
            parts.append(self._block(scope, h, end - lo)[: end - lo])
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return ids.tolist()

    def build(self, scope: str, hash_ids: list[int], n_in: int, block_size: int) -> BuiltPrompt:
        content = self.content_ids(scope, hash_ids, n_in, block_size)
        text = self.tok.decode(content)
        messages = [{"role": "user", "content": text}]
        expected = self.header + content + self.suffix
        if self.verify:
            rendered = self.tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            got = self._encode(rendered)
            if got != expected:
                at = next(
                    (i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                    min(len(got), len(expected)),
                )
                raise RuntimeError(
                    f"prompt for hash ids {hash_ids[:3]}... does not "
                    f"tokenize as built (first difference at token {at})"
                )
        return BuiltPrompt(
            messages=messages, token_ids=expected, expected_prompt_tokens=len(expected)
        )

    def blocks_of(self, token_ids: list[int], block_size: int) -> list[tuple[int, ...]]:
        """Full blocks of the first ``in`` tokens (tests use it)."""
        return [
            tuple(token_ids[i : i + block_size])
            for i in range(0, len(token_ids) - block_size + 1, block_size)
        ]


def scope_key(session_id: str, hash_id_scope: str) -> str:
    return "" if hash_id_scope == "global" else session_id
