"""The conversation of a code grading's two processes (tidal/rewards/_code_grader.py): frames,
values and a peer, shared by the grader (G) and the program's server (S).

Both sides speak length-prefixed frames of a small binary form over two pipes, and every
frame from the other side is read as untrusted: a malformed one raises ProtocolError, a
BaseException, so that nothing the tests or the program catch can hide it. Values cross as
tagged trees of plain types; anything else becomes a reference that the receiving side
turns into what it trusts (G: a handle, S: the object itself).

Standard library only, and run in the sandbox as part of one script with the other parts
(tidal.rewards.code joins them): it imports nothing of tidal.
"""

import os

MAX_FRAME = 64 << 20  # bytes of one message; a larger one from the program fails the grading
MAX_DEPTH = 200  # nesting of one value
PLAIN_SEQUENCES = {"l": list, "t": tuple, "S": set, "F": frozenset}


class ProtocolError(BaseException):
    """S sent something that is not a well-formed answer: the grading fails (a
    BaseException, so that a test's `except Exception` cannot hide it)."""


class ProgramExited(BaseException):
    """S is gone (the program exited, crashed or was killed): the grading fails."""


# -- frames -------------------------------------------------------------------------------


def read_exact(fd, n):
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def dumps(obj, out):
    """Append the frame bytes of `obj` (None, bool, int, str, list, dict of str keys) to `out`.
    A small binary form of its own: importing `json` (re, enum) took each interpreter 30 ms on
    a loaded 2-core machine, a sixth of a grading."""
    t = type(obj)
    if obj is None:
        out.append(b"N")
    elif t is bool:
        out.append(b"T" if obj else b"F")
    elif t is int:
        digits = b"%x" % obj
        out += [b"I", len(digits).to_bytes(4, "big"), digits]
    elif t is str:
        data = obj.encode("utf-8", "surrogatepass")
        out += [b"S", len(data).to_bytes(4, "big"), data]
    elif t is list:
        out += [b"L", len(obj).to_bytes(4, "big")]
        for item in obj:
            dumps(item, out)
    elif t is dict:
        out += [b"D", len(obj).to_bytes(4, "big")]
        for key, value in obj.items():
            dumps(str(key), out)
            dumps(value, out)
    else:
        raise TypeError(f"cannot frame a {t.__name__}")


class Reader:
    """Reads one `dumps` frame from the other side, which may be malformed on purpose."""

    def __init__(self, data):
        self.data, self.pos = memoryview(data), 0

    def take(self, n):
        if n < 0 or self.pos + n > len(self.data):
            raise ProtocolError("a message ends early")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def count(self):
        n = int.from_bytes(self.take(4), "big")
        if n > len(self.data) - self.pos:  # every item takes a byte at least
            raise ProtocolError("a message announces more items than it holds")
        return n

    def value(self, depth=0):
        if depth > 2 * MAX_DEPTH + 8:  # a value's tree nests twice per level, messages a few more
            raise ProtocolError("a message nested too deep")
        tag = bytes(self.take(1))
        if tag == b"N":
            return None
        if tag in (b"T", b"F"):
            return tag == b"T"
        if tag == b"I":
            try:
                return int(bytes(self.take(self.count())), 16)
            except ValueError:
                raise ProtocolError("a malformed integer") from None
        if tag == b"S":
            try:
                return bytes(self.take(self.count())).decode("utf-8", "surrogatepass")
            except UnicodeDecodeError:
                raise ProtocolError("a malformed string") from None
        if tag == b"L":
            return [self.value(depth + 1) for _ in range(self.count())]
        if tag == b"D":
            out = {}
            for _ in range(self.count()):
                key = self.value(depth + 1)
                if type(key) is not str:
                    raise ProtocolError("a dict key that is not a string")
                out[key] = self.value(depth + 1)
            return out
        raise ProtocolError(f"an unknown frame tag {tag!r}")


def send(fd, message):
    out = [b""]
    dumps(message, out)
    data = b"".join(out)
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        view = view[os.write(fd, view):]


def receive(fd):
    header = read_exact(fd, 4)
    if header is None:
        return None
    size = int.from_bytes(header, "big")
    if size > MAX_FRAME:
        raise ProtocolError(f"a message of {size} bytes is over the {MAX_FRAME} byte limit")
    data = read_exact(fd, size)
    if data is None:
        return None
    reader = Reader(data)
    message = reader.value()
    if reader.pos != len(data):
        raise ProtocolError("a message has bytes after its end")
    if not isinstance(message, list) or not message or type(message[0]) is not str:
        raise ProtocolError("a message is not a tagged list")
    return message


# -- values -------------------------------------------------------------------------------


def encode(value, ref, plain_only_exact=True, depth=0):
    """A value as a JSON tree. Plain values are copied; anything else becomes `ref(value)`.
    G encodes exact types only; S (`plain_only_exact=False`) also turns subclasses of plain
    types (namedtuple, IntEnum, OrderedDict…) and numpy values into their plain form."""
    if depth > MAX_DEPTH:
        raise ValueError(f"a value nested deeper than {MAX_DEPTH}")
    t = type(value)
    if value is None:
        return ["n"]
    if t is bool:
        return ["b", value]
    if t is int:
        return ["i", hex(value)]  # hex: exact, and free of int/str conversion limits
    if t is float:
        return ["f", value.hex()]
    if t is complex:
        return ["c", value.real.hex(), value.imag.hex()]
    if t is str:
        return ["s", value]
    if t is bytes:
        return ["y", value.hex()]
    for tag, kind in PLAIN_SEQUENCES.items():
        if t is kind:
            return [tag, [encode(v, ref, plain_only_exact, depth + 1) for v in value]]
    if t is dict:
        return ["d", [[encode(k, ref, plain_only_exact, depth + 1), encode(v, ref, plain_only_exact, depth + 1)]
                      for k, v in value.items()]]
    kind = (t.__module__, t.__qualname__)
    if kind == ("fractions", "Fraction"):
        return ["Q", hex(value.numerator), hex(value.denominator)]
    if kind == ("decimal", "Decimal"):
        return ["D", str(value)]
    if not plain_only_exact:
        plain = plain_form(value)
        if plain is not None:
            return encode(plain[0], ref, plain_only_exact, depth + 1)
    return ref(value)


def plain_form(value):
    """(plain value,) for a subclass of a plain type or a numpy value, else None (S only)."""
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return (value.tolist(),)
    for base in (int, float, complex, str, bytes, bytearray, tuple, list, frozenset, set, dict):
        if isinstance(value, base):
            if base is bytearray:
                return (bytes(value),)
            if base is dict:
                return (dict(value.items()),)
            return (base(value) if base not in (str, int, float) else base.__new__(base, value),)
    return None


def decode(node, handle, depth=0):
    """The value of a JSON tree from the other side, built only of plain types and of
    what `handle(tag, node)` makes of the non-plain tags."""
    if depth > MAX_DEPTH:
        raise ProtocolError(f"a value nested deeper than {MAX_DEPTH}")
    if type(node) is not list or not node or type(node[0]) is not str:
        raise ProtocolError("a value is not a tagged list")
    tag = node[0]
    try:
        if tag == "n":
            return None
        if tag == "b" and type(node[1]) is bool:
            return node[1]
        if tag == "i" and type(node[1]) is str:
            return int(node[1], 16)
        if tag == "f" and type(node[1]) is str:
            return float.fromhex(node[1])
        if tag == "c":
            return complex(float.fromhex(node[1]), float.fromhex(node[2]))
        if tag == "s" and type(node[1]) is str:
            return node[1]
        if tag == "y" and type(node[1]) is str:
            return bytes.fromhex(node[1])
        if tag in PLAIN_SEQUENCES and type(node[1]) is list:
            return PLAIN_SEQUENCES[tag](decode(v, handle, depth + 1) for v in node[1])
        if tag == "d" and type(node[1]) is list:
            return {decode(k, handle, depth + 1): decode(v, handle, depth + 1) for k, v in node[1]}
        if tag == "Q" and type(node[1]) is str and type(node[2]) is str:
            import fractions

            return fractions.Fraction(int(node[1], 16), int(node[2], 16))
        if tag == "D" and type(node[1]) is str and len(node[1]) < 10_000:
            import decimal

            return decimal.Decimal(node[1])
        if tag in ("h", "g"):
            return handle(tag, node)
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 — unhashable set members or keys, bad hex, a short node…
        raise ProtocolError(f"a malformed {tag!r} value: {type(e).__name__}: {e}") from None
    raise ProtocolError(f"an unknown value {str(node)[:80]}")


# -- a peer: one side of the conversation -------------------------------------------------


class Peer:
    """Sends requests and serves the other side's requests while it waits for the answer
    (a program calling back a test function, which calls the program again…)."""

    def __init__(self, read_fd, write_fd):
        self.read_fd, self.write_fd = read_fd, write_fd

    def request(self, message):
        try:
            send(self.write_fd, message)
        except (BrokenPipeError, ConnectionResetError):
            raise ProgramExited("the program's process ended") from None
        while True:
            reply = receive(self.read_fd)
            if reply is None:
                raise ProgramExited("the program's process ended")
            if reply[0] in ("ok", "raise", "stop"):
                return reply
            send(self.write_fd, self.serve(reply))

    def serve(self, message):
        raise NotImplementedError
