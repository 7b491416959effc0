"""``IncrementalDetokenizer`` releases text at token boundaries with each token's characters, so a streamed chunk's
text is its tokens' text and completions' ``text_offset`` indexes the answer; a possible stop-string prefix is held."""

from __future__ import annotations

from app.engine.detokenizer import IncrementalDetokenizer


class _ByteTokenizer:
    """Token i is the bytes ``pieces[i]``; ``decode`` joins them and decodes UTF-8 (U+FFFD where one is cut)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def _stream(pieces: list[bytes], stop: tuple[str, ...] = (), *,
            include_stop: bool = False) -> tuple[list[tuple[str, list[int]]], str]:
    """Each token added, then released (the last one final): the (text, text_lens) of each release, and the text."""
    detok = IncrementalDetokenizer(_ByteTokenizer(pieces), stop, include_stop=include_stop)
    releases = []
    for i in range(len(pieces)):
        detok.add(i)
        releases.append(detok.release(final=detok.stopped or i == len(pieces) - 1))
        if detok.stopped:
            break
    return releases, detok.text


def test_text_is_released_at_token_boundaries_holding_a_possible_stop_string():
    words = [b"The", b" capital", b" is", b" Paris", b".", b" The", b" ans", b"wer", b" is"]
    releases, text = _stream(words, stop=("answer",))
    assert text == "The capital is Paris. The "
    # "answer" is 6 characters: a token is released once 5 characters follow its end
    assert releases == [("", []), ("The", [3]), ("", []), (" capital is", [8, 3]), ("", []), (" Paris", [6]),
                        (".", [1]), (" The ", [4, 1, 0])]  # " ans": " " is the answer's, "wer" brings nothing
    assert "".join(t for t, _ in releases) == text and sum(sum(lens) for _, lens in releases) == len(text)
    assert sum(len(lens) for _, lens in releases) == 8  # every token of the answer, the stop string's included


def test_the_stop_string_itself_is_kept_on_request_the_earliest_one_ending_the_text():
    words = [b"The", b" capital", b" is", b" Paris", b".", b" The", b" ans", b"wer", b" is"]
    releases, text = _stream(words, stop=("is Paris", "Paris."), include_stop=True)
    assert text == "The capital is Paris"
    assert "".join(t for t, _ in releases) == text and sum(sum(lens) for _, lens in releases) == len(text)
    # two stop strings a token completes at one position: the first listed ends the text (vLLM's order)
    assert _stream(words, stop=("Paris", "Par"), include_stop=True)[1] == "The capital is Paris"
    assert _stream(words, stop=("Par", "Paris"), include_stop=True)[1] == "The capital is Par"
    for stop, hit in ((("Paris", "Par"), "Paris"), (("Par", "Paris"), "Par"), (("Paris.", "is Pa"), "is Pa")):
        detok = IncrementalDetokenizer(_ByteTokenizer(words), stop)
        for i in range(4):
            assert detok.stop_string is None
            detok.add(i)
        assert detok.stopped and detok.stop_string == hit  # vLLM's stop_reason


def test_a_shorter_stop_string_completed_before_the_checks_began_stays_text():
    """A stop string completed while stops were not checked (before ``min_tokens``) is kept as text, also when a
    longer stop string makes later checks look further back than it (vLLM looks per string)."""
    detok = IncrementalDetokenizer(_ByteTokenizer([b"ab", b"c", b"d", b"xyzw"]), ("ab", "xyzw"))
    detok.add(0, check_stop=False)
    detok.add(1, check_stop=False)
    detok.add(2)
    assert not detok.stopped and detok.text == "abcd"
    detok.add(3)
    assert detok.stopped and detok.stop_string == "xyzw" and detok.text == "abcd"


def test_a_character_split_between_tokens_is_released_with_its_last_token():
    star = "\N{GLOWING STAR}".encode()  # 4 bytes
    pieces = [b"A", star[:1], star[1:3], star[3:], b"B", star[:2]]  # ends inside a character
    releases, text = _stream(pieces)
    assert releases == [("A", [1]), ("", []), ("", []), ("\N{GLOWING STAR}", [0, 0, 1]), ("B", [1]), ("", [0])]
    assert text == "A\N{GLOWING STAR}B"
