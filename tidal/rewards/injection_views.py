"""The texts the injection detector (tidal/rewards/injection.py) reads in one answer: what a
grader model would read in it, whatever the encoding.

The choice: defence in depth before the rules run, not a longer list of phrases. First the
text is normalized (Unicode tag characters U+E0000-E007F decoded to the ASCII they hide and
removed from the visible text, zero-width and bidi controls removed, NFKC, diacritics and
Cyrillic/Greek look-alikes folded to ASCII in a second view). Then every place an instruction
can hide becomes a view of its own, scanned whole (never a prefix): HTML comments, base64,
hex and URL-encoded spans decoded, the whole text in rot13 and reversed, leetspeak tokens
(`1gn0r3`) read as letters, letters spelled out one by one (`i g n o r e`) joined. A view
that is not there (no base64 in the text) costs nothing; each decoded span is bounded.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import re
import unicodedata
import urllib.parse

# Zero-width, joiners, bidi embeddings/overrides/isolates, soft hyphen, variation selectors.
_INVISIBLE = re.compile("[\u00ad\u034f\u061c\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069"
                        "\ufe00-\ufe0f\ufeff]")
_TAGS = re.compile("[\U000e0000-\U000e007f]+")
# Latin look-alikes in Cyrillic and Greek: folded in a second view, so Russian text itself is
# still matched on the first.
CONFUSABLES = str.maketrans("аеіјоорсхуѕԁһӏвмнткαεіοορτυνκχɡɩ", "aeijoopcxysdhlbmhtkaeiooptuvkxgi")
_HTML_COMMENT = re.compile(r"<!--(.*?)(?:-->|\Z)", re.DOTALL)
_BASE64 = re.compile(r"[A-Za-z0-9+/_-]{16,}={0,2}")
_HEX = re.compile(r"(?:(?:0x|\\x)?[0-9a-fA-F]{2}[\s:,]?){8,}")
_URL = re.compile(r"%[0-9A-Fa-f]{2}")
_LEET_TOKEN = re.compile(r"\b(?=[\w@$|!]*[a-z])(?=[\w@$|!]*[0-9@$|!])[\w@$|!]{3,}\b")
_LEET = str.maketrans("0134578@$|!", "oieastbasli")
_SPELLED = re.compile(r"\b(?:[a-z](?: |[.\-_*]| {2,4})){5,}[a-z]\b")
MAX_DECODED = 64  # decoded spans per answer: a bound on the work an answer can ask for


def visible(text: str) -> tuple[str, str]:
    """(the text without invisible characters, NFKC; the ASCII hidden in tag characters)."""
    hidden = " ".join("".join(chr(ord(c) - 0xE0000) for c in m.group(0) if 0x20 <= ord(c) - 0xE0000 < 0x7F)
                      for m in _TAGS.finditer(text))
    text = _TAGS.sub("", _INVISIBLE.sub("", text))
    return unicodedata.normalize("NFKC", text), hidden


def fold_ascii(text: str) -> str:
    """Diacritics stripped and Cyrillic/Greek look-alikes folded (`ignоre` with a Cyrillic о)."""
    stripped = "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))
    return stripped.translate(CONFUSABLES)


def _printable(raw: bytes) -> str | None:
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    letters = sum(c.isalpha() or c.isspace() for c in s)
    return s if s and letters >= 0.8 * len(s) and re.search(r"[A-Za-z]{3}", s) else None


def decoded(text: str) -> dict[str, list[str]]:
    """The hidden and encoded readings of `text` (already visible-normalized), by how each was
    found: html-comment, base64, hex, url, rot13, reversed, leet, spelled."""
    out: dict[str, list[str]] = {}

    def add(kind: str, s: str | None) -> None:
        if s and sum(map(len, out.values())) < MAX_DECODED:
            out.setdefault(kind, []).append(s)

    for m in _HTML_COMMENT.finditer(text):
        add("html-comment", m.group(1))
    for m in _BASE64.finditer(text):
        span = m.group(0)
        for alt in (span, span.replace("-", "+").replace("_", "/")):
            try:
                add("base64", _printable(base64.b64decode(alt + "=" * (-len(alt) % 4), validate=True)))
                break
            except (binascii.Error, ValueError):
                continue
    for m in _HEX.finditer(text):
        digits = re.sub(r"0x|\\x|[\s:,]", "", m.group(0))
        try:
            add("hex", _printable(bytes.fromhex(digits[: len(digits) // 2 * 2])))
        except ValueError:
            pass
    if len(_URL.findall(text)) >= 3:
        add("url", urllib.parse.unquote(text))
    add("rot13", codecs.encode(text, "rot13"))
    add("reversed", text[::-1])
    low = text.casefold()
    if len(_LEET_TOKEN.findall(low)) >= 2:  # two mixed tokens: read every digit as a letter ("15" is "is")
        add("leet", low.translate(_LEET))
    if _SPELLED.search(low):
        # One separator between letters, several between words.
        add("spelled", _SPELLED.sub(lambda m: re.sub(r"[ .\-_*]", "", re.sub(r" {2,}", "\0", m.group(0))).replace(
            "\0", " "), low))
    return out
