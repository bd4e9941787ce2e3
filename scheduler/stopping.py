"""Stop conditions and incremental detokenisation for one request.

Speculative rounds emit several tokens at once, so a stop condition can fire in the middle of a round's tokens: the
tokens after it must be dropped (they were never produced by the target's own decoding in that position of the
stream). Stop strings are matched on text, so the text is produced incrementally and the tail that could still be
the beginning of a stop string is held back: no part of a stop string ever reaches the client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Decode = Callable[[Sequence[int]], str]


def tokenizer_decode(tokenizer: Any) -> Decode:
    """The :data:`Decode` of a transformers tokenizer: a flat list of ids to its text, special tokens dropped.

    ``tokenizer`` is taken untyped: transformers types ``decode`` for batches as well (``str | list[str]``),
    while a flat list of ids always decodes to one string."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything each round.

    Byte-level BPE tokens may split a UTF-8 character; a decode that ends in U+FFFD is incomplete and is retried
    once more tokens have arrived. A few tokens of left context (``prefix_offset``) make the decode of the new
    tokens merge exactly as in a full decode (leading-space handling of some tokenizers).

    ``skip``: characters of the coming text that were already emitted elsewhere and are dropped (see
    :meth:`resumed`).
    """

    decode: Decode
    tokens: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    skip: int = 0

    @classmethod
    def resumed(cls, decode: Decode, emitted: Sequence[int], emitted_chars: int) -> IncrementalDetokenizer:
        """A detokenizer that continues a request whose first tokens ``emitted`` were streamed, with the first
        ``emitted_chars`` characters of their text, by an earlier run of it (a scheduler that was lost).

        Nothing of ``emitted`` counts as read: the next push decodes them with the new tokens, so the text across
        the seam (a character split between tokens, a tokenizer's leading-space merge) is what one decode of the
        whole output gives, and the first ``emitted_chars`` characters of it, which the client has, are dropped.
        What the earlier run held back (an incomplete character) comes out here."""
        return cls(decode, [int(t) for t in emitted], skip=emitted_chars)

    def push(self, new_tokens: Sequence[int]) -> str:
        """Append tokens; return the newly complete text."""
        self.tokens.extend(int(t) for t in new_tokens)
        prefix_text = self.decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self.decode(self.tokens[self.prefix_offset :])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return self._skipped(delta)

    def flush(self) -> str:
        """Text of tokens still pending at the end of the request (an incomplete character is emitted as is)."""
        prefix_text = self.decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self.decode(self.tokens[self.prefix_offset :])
        self.read_offset = self.prefix_offset = len(self.tokens)
        return self._skipped(full_text[len(prefix_text) :])

    def _skipped(self, delta: str) -> str:
        if not self.skip:
            return delta
        cut = min(self.skip, len(delta))
        self.skip -= cut
        return delta[cut:]


@dataclass
class StopStringMatcher:
    """Finds the first stop string in streamed text and holds back any tail that may start one."""

    stops: tuple[str, ...]
    _pending: str = ""

    @property
    def holdback(self) -> int:
        return max((len(s) for s in self.stops), default=1) - 1

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was found). Text from the stop string on is dropped."""
        if not self.stops:
            return delta, False
        text = self._pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._pending = ""
            return text[: min(hits)], True
        keep = min(self.holdback, len(text))
        # Hold back only a tail that is a proper prefix of some stop string.
        cut = len(text)
        for k in range(keep, 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                cut = len(text) - k
                break
        self._pending = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        """At the end of the request the held-back tail is real output (no stop string completed)."""
        out, self._pending = self._pending, ""
        return out


def first_stop_token(tokens: Sequence[int], stop_ids: frozenset[int]) -> int:
    """Index of the first token in ``tokens`` that is a stop id, or -1."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return i
    return -1
