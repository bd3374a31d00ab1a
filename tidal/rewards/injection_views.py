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
import html
import re
import unicodedata
import urllib.parse

# Zero-width, joiners, bidi embeddings/overrides/isolates, soft hyphen, variation selectors.
_INVISIBLE = re.compile("[\u00ad\u034f\u061c\u115f\u1160\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064"
                        "\u2066-\u2069\u3164\ufe00-\ufe0f\ufeff\uffa0]")
_TAGS = re.compile("[\U000e0000-\U000e007f]+")
# Latin look-alikes in Cyrillic and Greek: folded in a second view, so Russian text itself is
# still matched on the first.
CONFUSABLES = str.maketrans("аеіјоорсхуѕԁһӏвмнткαεіοορτυνκχɡɩօսոհԁɑʀɪꜱᴀᴇᴏ",
                            "aeijoopcxysdhlbmhtkaeiooptuvkxgiounhdarisaeo")
_HTML_COMMENT = re.compile(r"<!--(.*?)(?:-->|\Z)", re.DOTALL)
_BASE64 = re.compile(r"[A-Za-z0-9+/_-]{16,}={0,2}")
_HEX = re.compile(r"(?:(?:0x|\\x)?[0-9a-fA-F]{2}[\s:,]?){8,}")
_URL = re.compile(r"%[0-9A-Fa-f]{2}")
_LEET_TOKEN = re.compile(r"\b(?=[\w@$|!]*[a-z])(?=[\w@$|!]*[0-9@$|!])[\w@$|!]{3,}\b")
_LEET = str.maketrans("0134578@$|!", "oieastbasli")
_SPELLED = re.compile(r"\b(?:[a-z](?: |[.\-_*]| {2,4})){5,}[a-z]\b")
_WRAPPED = re.compile(r"(?<=[A-Za-z0-9+/=])[ \t]*\n[ \t]*(?=[A-Za-z0-9+/])")
_ESCAPES = re.compile(r"\\u([0-9a-fA-F]{4})|\\x([0-9a-fA-F]{2})")
# Tags and emphasis that split a word: `Ig<b></b>nore`, `Ig**nore**`.
_MARKUP = re.compile(r"(?<=\w)(?:<[^<>\n]{0,40}>|[*_~`]{1,3})+(?=\w)")
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


def decoded(text: str, depth: int = 2) -> dict[str, list[str]]:
    """The hidden and encoded readings of `text` (already visible-normalized), by how each was
    found: html-comment, base64, hex, url, escapes (HTML entities, \\u escapes), markup (tags
    and emphasis inside words removed), rot13, reversed, word-reversed, leet, spelled. What a
    decoder reveals (base64 of rot13) is decoded again, `depth` levels in all."""
    out: dict[str, list[str]] = {}

    def add(kind: str, s: str | None, again: bool = True) -> None:
        if s and s != text and sum(map(len, out.values())) < MAX_DECODED:
            out.setdefault(kind, []).append(s)
            if again and depth > 1:
                for k, found in decoded(s, depth - 1).items():
                    for f in found:
                        add(f"{kind}+{k}", f, again=False)

    for m in _HTML_COMMENT.finditer(text):
        add("html-comment", m.group(1))
    # Base64 wrapped over lines is one span.
    for source in dict.fromkeys((text, _WRAPPED.sub("", text))):
        for m in _BASE64.finditer(source):
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
    if _ESCAPES.search(text):
        add("escapes", _ESCAPES.sub(_unescape, html.unescape(text)))
    elif "&" in text and html.unescape(text) != text:
        add("escapes", html.unescape(text))
    if _MARKUP.search(text):
        add("markup", re.sub(r"<[^<>\n]{0,40}>|[*_~`]", "", text), again=False)
    add("rot13", codecs.encode(text, "rot13"), again=False)
    add("reversed", text[::-1], again=False)
    add("word-reversed", re.sub(r"\S{2,}", lambda m: m.group(0)[::-1], text), again=False)
    low = text.casefold()
    if len(_LEET_TOKEN.findall(low)) >= 2:  # two mixed tokens: read every digit as a letter ("15" is "is")
        add("leet", low.translate(_LEET), again=False)
    if _SPELLED.search(low):
        # One separator between letters, several between words.
        add("spelled", _SPELLED.sub(lambda m: re.sub(r"[ .\-_*]", "", re.sub(r" {2,}", "\0", m.group(0))).replace(
            "\0", " "), low), again=False)
    return out


def _unescape(m: re.Match) -> str:
    try:
        return chr(int(m.group(1) or m.group(2), 16))
    except (ValueError, OverflowError):
        return m.group(0)
