"""The tests' side of a code grading (G, tidal/rewards/_code_grader.py): handles to the
program's objects, and the Grader peer that judges what comes back.

The choice: a value of the program is trusted only as a copy of a plain type. Any other
object stays in the program's process and G holds a ProgramObject for it, whose equality
with a value of the tests is False (the program never sees the expected value), whose `in`
iterates here, and whose other operations are the program's answers. A malformed answer
fails the grading for good (Grader.broken), even if a test catches the error.
"""
# ruff: noqa: BLE001, S110 — outliving whatever the tests' callbacks raise is this file's job.

import builtins

if __name__ != "__main__":  # imported on the host; in the sandbox the parts run as one script
    from tidal.rewards._code_wire import Peer, ProgramExited, ProtocolError, decode, encode


class ProgramError(Exception):
    """The program raised an exception that is not a built-in one (its own class, or a
    StopIteration, which would otherwise end the tests' own iterations silently)."""


class ProgramObject:
    """A handle to an object that lives in the program's process."""

    __slots__ = ("__weakref__", "_grader", "_hid")

    def __init__(self, hid, grader):
        object.__setattr__(self, "_hid", hid)
        object.__setattr__(self, "_grader", grader)

    def _ask(self, op, *args):
        return self._grader.ask([op, self._hid, *args])

    def __call__(self, *args, **kwargs):
        return self._grader.call(self._hid, args, kwargs)

    def __getattr__(self, name):
        if name in ("_hid", "_grader"):  # a copy made without __init__
            raise AttributeError(name)
        return self._ask("getattr", name)

    def __setattr__(self, name, value):
        self._ask("setattr", name, self._grader.encode(value))

    def __getitem__(self, key):
        return self._ask("getitem", self._grader.encode(key))

    def __setitem__(self, key, value):
        self._ask("setitem", self._grader.encode(key), self._grader.encode(value))

    def __len__(self):
        return self._ask("len")

    def __bool__(self):
        return self._ask("bool")

    def __iter__(self):
        return self._ask("iter")

    def __next__(self):
        return self._ask("next")

    def __contains__(self, item):
        # Iterated here: the program never sees what the tests look for.
        return any(item is x or item == x for x in self)

    def __int__(self):
        return self._ask("int")

    def __index__(self):
        return self._ask("index")

    def __float__(self):
        return self._ask("float")

    def __repr__(self):
        return self._ask("repr")

    def __str__(self):
        return self._ask("str")

    def __instancecheck__(self, value):
        return self._grader.ask(["isinstance", self._hid, self._grader.encode(value)])

    def __hash__(self):
        return object.__hash__(self)

    def _compare(self, op, other):
        if type(other) is not ProgramObject:
            # Against a value of the tests: never the program's own comparison, which would
            # see the expected value and could answer "equal" to everything.
            return NotImplemented
        return self._ask("compare", op, other._hid)

    def __eq__(self, other):
        return True if other is self else self._compare("eq", other)

    def __ne__(self, other):
        return False if other is self else self._compare("ne", other)

    def __lt__(self, other):
        return self._compare("lt", other)

    def __le__(self, other):
        return self._compare("le", other)

    def __gt__(self, other):
        return self._compare("gt", other)

    def __ge__(self, other):
        return self._compare("ge", other)


class Grader(Peer):
    def __init__(self, read_fd, write_fd):
        super().__init__(read_fd, write_fd)
        self.handles = {}  # hid -> ProgramObject, so that one program object has one handle
        self.functions = {}  # gid -> a function of the tests passed to the program
        self.broken = None  # why the conversation failed, kept even if a test catches the error

    def fail(self, why):
        self.broken = self.broken or why
        raise ProtocolError(why)

    def encode(self, value):
        def ref(obj):
            if type(obj) is ProgramObject:
                return ["h", obj._hid]
            if callable(obj):
                gid = len(self.functions)
                self.functions[gid] = obj
                return ["g", gid]
            raise TypeError(f"the tests passed a {type(obj).__name__} to the program: only plain values, "
                            "program objects and functions can cross")

        return encode(value, ref)

    def decode(self, node):
        def handle(tag, n):
            key = n[1] if len(n) == 2 else None
            if type(key) is not int or (tag == "g" and key not in self.functions):
                raise ProtocolError(f"a malformed reference {str(n)[:80]}")
            if tag == "g":
                return self.functions[key]
            if key not in self.handles:
                self.handles[key] = ProgramObject(key, self)
            return self.handles[key]

        try:
            return decode(node, handle)
        except ProtocolError as e:
            self.fail(str(e))

    def exchange(self, message):
        """The program's reply to one request; its exception raised here as the tests'
        side's own (the built-in class of that name, else ProgramError)."""
        try:
            reply = self.request(message)
        except ProgramExited as e:
            self.broken = self.broken or f"ProgramExited: {e}"
            raise
        except ProtocolError as e:
            self.fail(str(e))
        if reply[0] == "raise":
            if len(reply) != 4 or not all(type(x) is str for x in reply[1:]):
                self.fail(f"a malformed exception {str(reply)[:80]}")
            raise self.exception(*reply[1:])
        if reply[0] == "stop" and message[0] == "next":
            raise StopIteration
        return reply

    def ask(self, message):
        reply = self.exchange(message)
        if reply[0] != "ok" or len(reply) != 2:
            self.fail(f"an unexpected answer {str(reply)[:80]}")
        return self.decode(reply[1])

    def call(self, hid, args, kwargs):
        message = ["call", hid, [self.encode(a) for a in args], {str(k): self.encode(v) for k, v in kwargs.items()}]
        reply = self.exchange(message)
        if reply[0] != "ok" or len(reply) != 3 or type(reply[2]) is not list:
            self.fail(f"an unexpected answer to a call {str(reply)[:80]}")
        result = self.decode(reply[1])
        for item in reply[2]:
            where = item[0] if type(item) is list and len(item) == 2 else None
            if type(where) is int and 0 <= where < len(args):
                original = args[where]
            elif type(where) is str and where in kwargs:
                original = kwargs[where]
            else:
                self.fail(f"a malformed copy-back {str(item)[:80]}")
            self.copy_back(original, self.decode(item[1]))
        return result

    def copy_back(self, original, new):
        """The program's in-place changes to a list, dict or set it was given."""
        if type(original) is not type(new) or type(original) not in (list, dict, set):
            self.fail("a copy-back of another type")
        if type(original) is list:
            original[:] = new
        else:
            original.clear()
            original.update(new)

    @staticmethod
    def exception(module, name, message):
        """The built-in exception class of that name (an Exception, StopIteration excepted:
        it would end the tests' own iterations silently), else ProgramError."""
        cls = getattr(builtins, name, None) if module == "builtins" else None
        if (isinstance(cls, type) and issubclass(cls, Exception)
                and not issubclass(cls, (StopIteration, StopAsyncIteration))):
            try:
                return cls(message)
            except Exception:
                pass
        return ProgramError(f"{module}.{name}: {message}")

    def serve(self, message):
        """The program calls back a function of the tests."""
        if (message[0] != "callback" or len(message) != 4 or message[1] not in self.functions
                or type(message[2]) is not list or type(message[3]) is not dict):
            self.fail(f"an unexpected request {str(message)[:80]}")
        fn = self.functions[message[1]]
        args = [self.decode(a) for a in message[2]]
        kwargs = {str(k): self.decode(v) for k, v in message[3].items()}
        try:
            return ["ok", self.encode(fn(*args, **kwargs))]
        except Exception as e:
            return ["raise", type(e).__module__, type(e).__name__, str(e)[:2000]]
