"""Request migration: a decode pod lost after tokens were streamed, the
request resumes on another pod and the client's stream goes on as if nothing
happened. Pure bookkeeping, no I/O: ``pd.Orchestrator`` runs the calls.

The resumed request's prompt is the original prompt plus every token already
sent (token ids, never re-tokenized text), with ``max_tokens`` and
``min_tokens`` reduced by what was sent and the other sampling parameters
unchanged, so a greedy request continues exactly where it stopped. The new
engine primes its incremental detokenizer with its prompt (vLLM's
``DecodeStream(ids=prompt)``), so its first text delta joins the text already
sent, a half-sent UTF-8 character included.

Two things the engines cannot do across the seam, done here:
* Usage: the client sees the original prompt's token count and every token
  generated on any pod (the last pod counts the sent tokens as prompt).
* Stop strings: an engine holds back the last ``len(longest stop) - 1``
  characters of its text while a stop string might still complete, and only
  matches stop strings inside its own output. The text the lost pod held back
  (``pending``) is recovered by detokenizing the sent tokens, held until
  enough new text arrived to rule out a stop string spanning the seam, then
  released or cut at the stop string.

What does not carry over: a structured-output constraint (the new engine's
grammar would start from the beginning: such requests are not migrated); a
seeded sampler's random state (a seeded request stays deterministic, but its
continuation differs from an undisturbed run); frequency and presence
penalties (vLLM counts them over output tokens, and the sent tokens become
prompt there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.proto import engine_pb2 as pb

# Why a lost request was not resumed (the `outcome` of the migrations metric;
# "resumed" and "failed" are the others).
DISABLED = "disabled"  # --max-migrations 0
LIMIT = "refused_limit"  # this request already migrated --max-migrations times
DEADLINE = "refused_deadline"  # the request's time is up
UNSUPPORTED = "refused_unsupported"  # structured output: the grammar state cannot move


@dataclass(frozen=True)
class Resume:
    """What the resumed engine request differs in."""

    request_id: str
    token_ids: list[int]
    sampling: pb.SamplingParams


class _Seam:
    """Stop strings across one seam: the lost pod's held-back text, held
    with the new pod's first text until no stop string can start in it and
    end in the new text."""

    def __init__(self, pending: str, stops: Sequence[str]) -> None:
        self._held = pending
        self._before = len(pending)  # characters of held text from before the seam
        self._stops = list(stops)
        self._needed = len(pending) + max(len(s) for s in stops) - 1

    def feed(self, text: str, final: bool) -> tuple[str, bool] | None:
        """None while still holding; else (text to release, stopped at a
        stop string). Once it has answered, the seam is passed."""
        self._held += text
        if not final and len(self._held) < self._needed:
            return None
        starts = [i for s in self._stops if 0 <= (i := self._held.find(s)) < self._before]
        if starts:
            return self._held[: min(starts)], True
        return self._held, False


@dataclass
class Migration:
    """One request's migration state: what was sent, how often it moved."""

    request_id: str
    prompt: list[int]
    sampling: pb.SamplingParams
    max_migrations: int
    # Text of token ids as the engines detokenize them; None: the held-back
    # text of a stop-string request is not recovered (then it is lost).
    detokenize: Callable[[list[int]], str] | None = None
    generated: list[int] = field(default_factory=list)
    migrations: int = 0
    stopped: bool = False  # a stop string across the seam ended the request
    _sent: list[str] = field(default_factory=list)
    _seam: _Seam | None = None
    _held: pb.GenerateResponse = field(default_factory=pb.GenerateResponse)

    @property
    def sent_text(self) -> str:
        return "".join(self._sent)

    def refusal(self, now: float, deadline: float) -> str | None:
        """Why the request must not resume now; None when it may."""
        if self.max_migrations <= 0:
            return DISABLED
        if self.migrations >= self.max_migrations:
            return LIMIT
        if now >= deadline:
            return DEADLINE
        if self.sampling.HasField("structured"):
            return UNSUPPORTED
        return None

    def relay(self, message: pb.GenerateResponse) -> pb.GenerateResponse | None:
        """The message to send the client for an engine message (None: hold
        it back), with the seam's text and the request's usage."""
        self.generated.extend(message.token_ids)
        final = bool(message.finish_reason)
        if self._seam is not None:
            released = self._seam.feed(message.text, final)
            # Held messages' tokens go out with the text they made, so that
            # parsers that read token ids see every one.
            held = self._held
            held.token_ids.extend(message.token_ids)
            held.logprobs.extend(message.logprobs)
            if released is None:
                return None
            self._seam, self._held = None, pb.GenerateResponse()
            text, stopped = released
            held.text, held.finish_reason = text, message.finish_reason
            held.usage.CopyFrom(message.usage)
            message = held
            if stopped:
                self.stopped = True
                message.finish_reason = "stop"
        if message.finish_reason and self.migrations:
            message = _copy(message)
            message.usage.CopyFrom(self.usage(message.usage))
        self._sent.append(message.text)
        return message

    def usage(self, last: pb.Usage) -> pb.Usage:
        """The whole request's usage from the last pod's: the original
        prompt; every token generated on any pod; cached tokens of the
        prompt (the last pod's hits, at most the prompt)."""
        return pb.Usage(
            prompt_tokens=len(self.prompt),
            completion_tokens=len(self.generated),
            cached_tokens=min(last.cached_tokens, len(self.prompt)),
        )

    def resume(self) -> Resume | None:
        """The next attempt's request; None when the token budget is spent
        (then `exhausted` ends the request)."""
        remaining = self.sampling.max_tokens - len(self.generated)
        self.migrations += 1
        if remaining <= 0:
            return None
        sampling = pb.SamplingParams()
        sampling.CopyFrom(self.sampling)
        sampling.max_tokens = remaining
        if sampling.HasField("min_tokens"):
            sampling.min_tokens = max(0, sampling.min_tokens - len(self.generated))
        pending = self._pending()
        self._seam = _Seam(pending, sampling.stop) if pending and sampling.stop else None
        return Resume(
            request_id=f"{self.request_id}-m{self.migrations}",
            token_ids=self.prompt + self.generated,
            sampling=sampling,
        )

    def exhausted(self) -> pb.GenerateResponse:
        """The final message of a request lost after its last token (before
        the engine's final message): its budget is spent, so it ends as
        "length" with any held-back text."""
        pending = self._pending()
        self._seam = None
        message = pb.GenerateResponse(text=pending, finish_reason="length")
        message.usage.CopyFrom(self.usage(pb.Usage()))
        self._sent.append(pending)
        return message

    def _pending(self) -> str:
        """Text of the sent tokens that the client has not seen: what the
        lost pod held back for its stop strings (a trailing incomplete UTF-8
        character excluded: the next pod's detokenizer completes it)."""
        if self.detokenize is None or not self.sampling.stop:
            return ""
        full = self.detokenize(self.generated).rstrip("\ufffd")
        sent = self.sent_text
        return full[len(sent) :] if full.startswith(sent) else ""


def _copy(message: pb.GenerateResponse) -> pb.GenerateResponse:
    copy = pb.GenerateResponse()
    copy.CopyFrom(message)
    return copy
