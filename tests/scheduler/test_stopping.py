"""Stop strings never leak; incremental detokenisation equals a full decode."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler.stopping import IncrementalDetokenizer, StopStringMatcher, first_stop_token


def _stream(matcher: StopStringMatcher, chunks: list[str]) -> tuple[str, bool]:
    out = []
    for chunk in chunks:
        text, hit = matcher.feed(chunk)
        out.append(text)
        if hit:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


@given(st.lists(st.text(alphabet="abc\n", max_size=6), max_size=12), st.text(alphabet="abc\n", min_size=1, max_size=4))
def test_stop_string_output_is_the_prefix_before_the_first_match(chunks: list[str], stop: str) -> None:
    full = "".join(chunks)
    text, hit = _stream(StopStringMatcher((stop,)), chunks)
    if stop in full:
        assert hit and text == full[: full.index(stop)]
    else:
        assert not hit and text == full
    assert stop not in text


def test_held_back_prefix_is_released_when_it_does_not_complete() -> None:
    m = StopStringMatcher(("STOP",))
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("ART") == ("START", False)


def test_first_stop_token() -> None:
    assert first_stop_token([5, 6, 7, 6], frozenset({6})) == 1
    assert first_stop_token([5], frozenset({6})) == -1


def test_incremental_detokenizer_with_split_utf8() -> None:
    # A toy byte-level tokenizer: each token is one byte.
    text = "héllo wörld ✓"
    data = list(text.encode())

    def decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    det = IncrementalDetokenizer(decode)
    out = "".join(det.push([b]) for b in data) + det.flush()
    assert out == text


def test_a_resumed_detokenizer_continues_the_text_across_the_seam() -> None:
    """A stream cut after any byte (mid-character too) and resumed from the bytes and the characters the client
    got gives the whole text once: nothing repeated, nothing lost."""
    text = "héllo wörld ✓ done"
    data = list(text.encode())

    def decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    for cut in range(1, len(data)):
        first = IncrementalDetokenizer(decode)
        sent = "".join(first.push([b]) for b in data[:cut])  # what the client received before the cut
        resumed = IncrementalDetokenizer.resumed(decode, data[:cut], len(sent))
        rest = "".join(resumed.push([b]) for b in data[cut:]) + resumed.flush()
        assert sent + rest == text, cut
