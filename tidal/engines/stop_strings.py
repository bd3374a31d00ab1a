"""Stop strings for an engine that samples token ids: which token completes one.

The contract (every engine): generation ends with the token whose text completes a stop
string; that token is kept, so the tokens are exactly those sampled, and the finish
reason is "stop". Only generated text counts: a stop string in the prompt, or one that
starts in the prompt and ends in the generation, ends nothing. The text is the generated
tokens decoded with special tokens skipped — what the environment sees (`Action.text`)
and what vLLM matches in (its `skip_special_tokens=True`).

The choice: check after every sampled token, decoding only a window of the row's last
tokens, never the whole generation. A stop string that completes at token n ends inside
that token's text and starts at most len(stop) - 1 characters earlier, so the window only
has to hold that many characters before token n; it starts at len(longest stop) + 4
tokens and doubles while it holds too few (tokens that decode to nothing: special tokens,
pieces of one UTF-8 character). Checking every token finds the first completion, so a
match anywhere in the window is that completion. A cheaper pre-check skips the decode on
most steps: when every stop string ends in a visible ASCII character, the new token's own
text must contain one of those final characters.
"""

from __future__ import annotations

from collections.abc import Sequence

# Characters a window may lose at its left edge: a cut UTF-8 character decodes to up to 3
# replacement characters, and a tokenizer may drop a leading space of the first token.
_EDGE_SLACK = 4


def check_stop_strings(stop: Sequence[str], where: str) -> None:
    """Raise TypeError or ValueError for stop strings that cannot work (`where` names the request)."""
    if isinstance(stop, str):
        raise TypeError(f"{where}: SamplingParams.stop must be a tuple of strings, got the string {stop!r}")
    bad = [s for s in stop if not isinstance(s, str) or not s]
    if bad:
        raise ValueError(f"{where}: stop strings must be non-empty strings, got {bad!r}")


class StopStringMatcher:
    """Answers "does the newest token complete a stop string?" for one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._piece: dict[int, str] = {}  # token id → its text alone (the pre-check)
        self.windows = 0  # checks that decoded a window (the others the pre-check answered)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _piece_of(self, token: int) -> str:
        piece = self._piece.get(token)
        if piece is None:
            piece = self._piece[token] = self._decode([token])
        return piece

    def completes(self, generated: Sequence[int], stop: Sequence[str]) -> bool:
        """True when `generated[-1]` completes one of `stop` in the text of `generated`,
        given that no earlier token did (the caller checks after every token)."""
        if not generated or not stop:
            return False
        piece = self._piece_of(generated[-1])
        finals = {s[-1] for s in stop}
        if all(c.isascii() and c.isprintable() and not c.isspace() for c in finals) and not any(
                c in piece for c in finals):
            return False
        self.windows += 1
        longest = max(len(s) for s in stop)
        n, width = len(generated), longest + _EDGE_SLACK
        while True:
            start = max(0, n - width)
            text = self._decode(generated[start:])
            if any(s in text for s in stop):
                return True
            if start == 0 or len(text) - len(piece) >= longest - 1 + _EDGE_SLACK:
                return False
            width *= 2
