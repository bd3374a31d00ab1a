"""The two programs of a code grading inside the sandbox: the grader and the program's server.

`tidal.rewards.code` runs this file as the sandbox's main script: the grader, G. G reads a
per-run token and the tests from stdin, drops every writable directory from its import
path, and starts the server, S: a new interpreter (exec'd, so it shares no memory with G)
running this same file, which reports ready before it imports anything of the program.
Meanwhile G points its stdin at /dev/null and makes itself non-dumpable: no process of its
uid can then read its memory or its /proc files (fd, environ, mem, maps) or ptrace it,
which needs a capability the sandbox does not have. Only then does G ask S to import the
program.

The tests run in G. Each use of a program name crosses to S as a message, so the program
sees the arguments of its calls and nothing else: not the tests' code or frames, not the
expected values, not the token. Results come back as copies, and only of plain types
(None, bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset, and the
standard library's Fraction and Decimal), which G compares with its own operators. Any other object stays in S; G holds a handle to it whose
equality with a plain value is False (an object that "equals everything" equals nothing
here), whose `in` iterates, and whose truth, length, items, attributes and calls are the
program's answers, like a returned value. Lists, dicts and sets passed to the program are
copied back after the call (in-place mutation works); functions of the tests may be
passed and are called back in G.

G prints `<token> pass` when the tests ran to their end and S still answers, `<token>
fail: <why>` otherwise, `<token> error: <why>` when the grading itself could not start
(before any program code ran; the reward raises then, never scores 0). A program that
exits, crashes or kills G leaves no token line.

Standard library only (and few modules of it: each import is paid by every grading); both
sides speak length-prefixed frames of a small binary form over two pipes.
"""
# ruff: noqa: S102, BLE001, S110 — running the tests, and outliving whatever the program raises, is this file's job.

import builtins
import os
import sys

MAX_FRAME = 64 << 20  # bytes of one message; a larger one from the program fails the grading
MAX_DEPTH = 200  # nesting of one value
PR_SET_DUMPABLE, PR_GET_DUMPABLE = 4, 3
COMPILED_NAME = "_tidal_grader.bin"  # this file compiled (marshal), beside main.py in the workspace
PLAIN_SEQUENCES = {"l": list, "t": tuple, "S": set, "F": frozenset}


class ProtocolError(BaseException):
    """S sent something that is not a well-formed answer: the grading fails (a
    BaseException, so that a test's `except Exception` cannot hide it)."""


class ProgramExited(BaseException):
    """S is gone (the program exited, crashed or was killed): the grading fails."""


class ProgramError(Exception):
    """The program raised an exception that is not a built-in one (its own class, or a
    StopIteration, which would otherwise end the tests' own iterations silently)."""


# -- frames -------------------------------------------------------------------------------


def _read_exact(fd, n):
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


class _Reader:
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


def _send(fd, message):
    out = [b""]
    dumps(message, out)
    data = b"".join(out)
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        view = view[os.write(fd, view):]


def _receive(fd):
    header = _read_exact(fd, 4)
    if header is None:
        return None
    size = int.from_bytes(header, "big")
    if size > MAX_FRAME:
        raise ProtocolError(f"a message of {size} bytes is over the {MAX_FRAME} byte limit")
    data = _read_exact(fd, size)
    if data is None:
        return None
    reader = _Reader(data)
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
        plain = _plain_form(value)
        if plain is not None:
            return encode(plain[0], ref, plain_only_exact, depth + 1)
    return ref(value)


def _plain_form(value):
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
    except Exception as e:  # unhashable set members or keys, bad hex, a short node…
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
            _send(self.write_fd, message)
        except (BrokenPipeError, ConnectionResetError):
            raise ProgramExited("the program's process ended") from None
        while True:
            reply = _receive(self.read_fd)
            if reply is None:
                raise ProgramExited("the program's process ended")
            if reply[0] in ("ok", "raise", "stop"):
                return reply
            _send(self.write_fd, self.serve(reply))

    def serve(self, message):
        raise NotImplementedError


# -- the grader (G) -----------------------------------------------------------------------


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


class HarnessError(Exception):
    """The grading could not start (before any program code ran)."""


def grader_main():
    workspace = os.getcwd()
    # Nothing the program can write may be imported here: the workspace, /tmp and (in the
    # sandbox, where only those two are writable) any other writable directory go. Host
    # root (isolation=unsafe_host, trusted code only) can write everywhere: that test would
    # drop the standard library.
    scratch = tuple(os.path.realpath(d) + "/" for d in (workspace, "/tmp"))

    def importable(path):
        real = os.path.realpath(path) + "/" if path else ""
        return real and not real.startswith(scratch) and (os.geteuid() == 0 or not os.access(path, os.W_OK))

    sys.path[:] = [p for p in sys.path if importable(p)]
    # stdin: the token, the program's module name, then the tests.
    token, module_name, tests = sys.stdin.buffer.read().decode("utf-8", "surrogatepass").split("\n", 2)
    server_pid = None
    try:
        # The program's interpreter boots while this one hides itself; until it is told
        # to import the program it runs only this file's code.
        server_pid, grader = start_server(workspace)
        hide_this_process()
        wait_until_ready(grader)
    except HarnessError as e:
        if server_pid is not None:
            stop(server_pid)
        sys.stdout.write(f"\n{token} error: {e}\n")
        return
    failure = run_tests(grader, tests, module_name)
    ended = stop(server_pid)
    if failure is not None and "ProgramExited" in failure:
        failure += f" ({ended})"
    verdict = "pass" if failure is None else "fail: " + failure.replace("\n", " ")
    sys.stdout.write(f"\n{token} {verdict}\n")


def start_server(workspace):
    """Start `python <this file> serve` with two pipes to this process and nothing else of it."""
    to_server_r, to_server_w = os.pipe()
    from_server_r, from_server_w = os.pipe()
    keep = {to_server_r, from_server_w}
    for name in os.listdir("/proc/self/fd"):  # e.g. the sandbox runner's status pipe
        fd = int(name)
        if fd > 2:
            try:
                os.set_inheritable(fd, fd in keep)
            except OSError:
                pass  # the listing's own descriptor, closed by now
    flags = ["-I", "-B"] + (["-S"] if sys.flags.no_site else [])
    # This file's code, compiled once by the host (tidal.rewards.code: a file in the workspace,
    # read before any program code runs), spares the interpreter compiling it.
    boot = "import marshal,sys\nwith open(sys.argv[-1],'rb') as f:\n exec(marshal.loads(f.read()))"
    argv = [sys.executable, *flags, "-c", boot, "serve", str(to_server_r), str(from_server_w), workspace,
            os.path.join(workspace, COMPILED_NAME)]
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0), (os.POSIX_SPAWN_DUP2, 2, 1)]
    try:
        pid = os.posix_spawn(sys.executable, argv, dict(os.environ), file_actions=actions, setsid=True)
    except OSError as e:
        raise HarnessError(f"starting the program's interpreter failed: {e}") from None
    finally:
        os.close(to_server_r)
        os.close(from_server_w)
    return pid, Grader(from_server_r, to_server_w)


def hide_this_process():
    """No descriptor of the payload left, and no access to this process for its uid: its
    memory, /proc/<pid>/{mem,environ,fd,…} and ptrace need a capability the sandbox lacks."""
    import ctypes

    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the memfd that held the payload goes with its last descriptor
    os.close(devnull)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 or libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise HarnessError(f"prctl(PR_SET_DUMPABLE, 0) failed (errno {ctypes.get_errno()})")


def wait_until_ready(grader):
    try:
        ready = _receive(grader.read_fd)
    except ProtocolError as e:
        ready = str(e)
    if ready != ["ready"]:  # sent before the program is imported: not the program's doing
        raise HarnessError(f"the program's interpreter did not start (it said {ready!r})")


SIGKILL, SIGXCPU, SIGXFSZ = 9, 24, 25  # Linux numbers (`signal` imports enum)


def stop(pid):
    """Kill the program's process group and reap it; how its process had ended, if it had:
    a zombie keeps the status of its own death, SIGKILL here does not replace it."""
    try:
        os.killpg(pid, SIGKILL)
    except OSError:
        pass
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return "unknown"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return {SIGXCPU: "killed at its CPU time limit (SIGXCPU)", SIGXFSZ: "killed at its file size limit (SIGXFSZ)",
                SIGKILL: "killed (SIGKILL)"}.get(sig, f"killed by signal {sig}")
    return f"exit code {os.WEXITSTATUS(status)}"


def run_tests(grader, tests, module_name):
    """Why the tests failed, or None when they ran to their end and the program still answers."""
    failure = None
    try:
        names = grader.ask(["import", module_name])
        if type(names) is not dict or not all(type(name) is str for name in names):
            grader.fail("the program's names are not a dict of strings")
        module = type(sys)(module_name)
        # The tests are this process's main script: `unittest.main()` finds their TestCases.
        tests_module = type(sys)("__main__")
        sys.modules["__main__"] = tests_module
        namespace = tests_module.__dict__
        namespace["__builtins__"] = builtins
        for name, value in names.items():
            setattr(module, name, value)
            # The program's own `len`, `print` or `isinstance` would answer for the tests.
            if not name.startswith("__") and not hasattr(builtins, name):
                namespace[name] = value
        sys.modules[module_name] = module
        exec(compile(tests, "<tests>", "exec"), namespace)
    except SystemExit as e:
        if e.code not in (None, 0, False):  # unittest.main() ends with SystemExit(False) when all pass
            failure = f"the tests exited with {e.code!r}"
    except BaseException as e:
        failure = f"{type(e).__name__}: {e}"[:500]
        import traceback  # only from read-only places: the import path holds nothing writable

        traceback.print_exc(file=sys.stderr)
    if failure is None and grader.broken is None:
        try:
            if grader.ask(["ping"]) != "pong":
                failure = "the program's process gave a wrong answer to the final check"
        except BaseException as e:
            failure = f"the program's process did not answer the final check ({type(e).__name__}: {e})"
    if grader.broken is not None:
        failure = f"the conversation with the program broke: {grader.broken}"
    return failure


# -- the program's server (S) -------------------------------------------------------------


class Server(Peer):
    def __init__(self, read_fd, write_fd):
        super().__init__(read_fd, write_fd)
        self.objects = {}  # hid -> object kept alive for G's handles
        self.hids = {}  # id(object) -> hid

    def ref(self, obj):
        key = id(obj)
        if key not in self.hids:
            hid = len(self.objects)
            self.objects[hid] = obj
            self.hids[key] = hid
        return ["h", self.hids[key]]

    def encode(self, value):
        return encode(value, self.ref, plain_only_exact=False)

    def decode(self, node):
        def handle(tag, n):
            if tag == "h":
                return self.objects[n[1]]
            return self.callback_stub(n[1])

        return decode(node, handle)

    def callback_stub(self, gid):
        def call_the_tests(*args, **kwargs):
            reply = self.request(["callback", gid, [self.encode(a) for a in args],
                                  {str(k): self.encode(v) for k, v in kwargs.items()}])
            if reply[0] == "ok":
                return self.decode(reply[1])
            raise RuntimeError(f"a function of the tests raised {reply[2]}: {reply[3]}")

        return call_the_tests

    def serve(self, message):
        try:
            return self.answer(message)
        except StopIteration:
            return ["stop"] if message[0] == "next" else self.raised(StopIteration("raised by the program"))
        except Exception as e:
            return self.raised(e)

    @staticmethod
    def raised(e):
        return ["raise", str(type(e).__module__), str(type(e).__name__), str(e)[:2000]]

    def answer(self, message):
        op = message[0]
        if op == "ping":
            return ["ok", self.encode("pong")]
        if op == "import":
            __import__(message[1])  # importlib's own import costs a grading 10 ms
            module = sys.modules[message[1]]
            names = {name: value for name, value in vars(module).items() if not name.startswith("__")}
            return ["ok", ["d", [[self.encode(k), self.encode(v)] for k, v in names.items()]]]
        if op == "call":
            args = [self.decode(a) for a in message[2]]
            kwargs = {k: self.decode(v) for k, v in message[3].items()}
            result = self.objects[message[1]](*args, **kwargs)
            mutable = (list, dict, set)
            back = [[i, self.encode(a)] for i, a in enumerate(args) if type(a) in mutable]
            back += [[k, self.encode(v)] for k, v in kwargs.items() if type(v) in mutable]
            return ["ok", self.encode(result), back]
        if op == "isinstance":
            return ["ok", self.encode(isinstance(self.decode(message[2]), self.objects[message[1]]))]
        obj = self.objects[message[1]]
        if op == "getattr":
            return ["ok", self.encode(getattr(obj, message[2]))]
        if op == "setattr":
            setattr(obj, message[2], self.decode(message[3]))
            return ["ok", ["n"]]
        if op == "getitem":
            return ["ok", self.encode(obj[self.decode(message[2])])]
        if op == "setitem":
            obj[self.decode(message[2])] = self.decode(message[3])
            return ["ok", ["n"]]
        if op == "compare":
            import operator

            compare = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
                       "gt": operator.gt, "ge": operator.ge}[message[2]]
            return ["ok", self.encode(compare(obj, self.objects[message[3]]))]
        simple = {"len": len, "bool": bool, "iter": iter, "next": next, "int": int, "index": lambda o: o.__index__(),
                  "float": float, "repr": repr, "str": str}
        if op in simple:
            return ["ok", self.encode(simple[op](obj))]
        raise ValueError(f"unknown request {op!r}")


def server_main(read_fd, write_fd, workspace):
    import operator  # noqa: F401 — before the workspace is on the path

    server = Server(read_fd, write_fd)
    _send(write_fd, ["ready"])
    sys.path.insert(0, workspace)
    while True:
        message = _receive(read_fd)
        if message is None:
            return
        _send(write_fd, server.serve(message))


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        server_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        grader_main()
