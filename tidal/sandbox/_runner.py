"""The program that runs inside every sandbox, before and around the untrusted code.

It is started before its work is known (that is what makes a warm sandbox possible) and
blocks on the request pipe. The host sends it compiled (by the sandbox's own interpreter,
so the bytecode always matches) and starts it with a one-line bootstrap. Its parent is the
supervisor, the sandbox's init (PID 1): the native one (_supervisor.c), or, where that
cannot be built, this runner's own parent half (it forks at once, while warm). On a
request the code's process (this one, or the forked child) materializes files and stdin,
sets the resource limits, writes "S" on the status pipe, closes it and runs the code. The
supervisor reports the code's end there as "D<exit code> <signal> <cpu seconds>" from
wait4: the host's account of a run. Once the code runs, only the supervisor holds the
status pipe, and the sandbox's /proc/1 (the supervisor) is masked, so the code (same uid)
can neither open that pipe through /proc nor write the supervisor's memory, nor signal it
(PID 1).

Modes of a request:
- `python`: run `code` as the `__main__` of the warm interpreter (no second interpreter
  start); at its end, as at interpreter exit: non-daemon threads are joined, atexit runs.
- `exec`: the child executes the command (its exact signal and CPU time are reported,
  which bubblewrap's 128+N exit code cannot tell apart from a chosen exit code).
- `python_session`: the child keeps one `__main__` namespace and runs one code chunk per
  frame read from the request pipe, ending each turn's stdout and stderr with a token line
  (the turn reports come from the code's own process: as trustworthy as the code,
  docs/sandbox.md; the session's end is reported by the supervisor).

Only built-in modules (`posix`, not `os`: importing `os` alone costs a millisecond per
run), `resource`, and `_ctypes` for prctl where the filter is off.
"""
# ruff: noqa: S102, BLE001, S110 — executing arbitrary code, and outliving whatever it raises, is this file's job.

import marshal
import posix
import sys

WORKSPACE_FILE_MODE = 0o644


def _read_exact(fd, n):
    chunks = []
    while n:
        chunk = posix.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd):
    header = _read_exact(fd, 8)
    if header is None:
        return None
    payload = _read_exact(fd, int.from_bytes(header, "little"))
    return None if payload is None else marshal.loads(payload)


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[posix.write(fd, view):]


def _makedirs(directory):
    path = ""
    for part in directory.split("/")[1:]:
        path += "/" + part
        try:
            posix.mkdir(path, 0o755)
        except FileExistsError:
            pass


def _set_up(request):
    """Files, stdin and limits. Files are written before the limits (they come from the
    host, trusted, and may be larger than what the code itself may write)."""
    import resource

    workspace = request["workspace"]
    for relative_path, data in request["files"].items():
        path = workspace + "/" + relative_path
        _makedirs(path.rsplit("/", 1)[0])
        fd = posix.open(path, posix.O_WRONLY | posix.O_CREAT | posix.O_TRUNC | posix.O_CLOEXEC, WORKSPACE_FILE_MODE)
        _write_all(fd, data)
        posix.close(fd)
    if not request.get("keep_stdin"):
        # A memfd behaves like a file (seekable, EOF at the end) and needs no path.
        fd = posix.memfd_create("stdin")
        _write_all(fd, request["stdin"])
        posix.lseek(fd, 0, 0)
        posix.dup2(fd, 0)
        posix.close(fd)
    posix.chdir(workspace)
    limits = request["limits"]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # SIGXCPU at the soft limit (the host reads it as a timeout), SIGKILL a second later.
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["max_open_files"], limits["max_open_files"]))
    # Inside its own user namespace this counts the sandbox's processes only (kernel
    # ucounts are per namespace); run as host root it would not be enforced at all.
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"], limits["max_processes"]))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))


def _fresh_main_namespace(path):
    """A new `__main__` module for the user's code: this runner's names stay out of it, and
    pickle still finds the user's classes through sys.modules["__main__"]."""
    import builtins

    module = type(sys)("__main__")
    module.__dict__.update(__builtins__=builtins, __file__=path)
    sys.modules["__main__"] = module
    return module.__dict__


def _report_exception():
    """Print the traceback as the interpreter would, without this runner's frame."""
    exc_type, exc, tb = sys.exc_info()
    tb = tb.tb_next if tb is not None else None
    sys.excepthook(exc_type, exc.with_traceback(tb), tb)


def _system_exit_code(exc):
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    sys.stderr.write(str(code) + "\n")
    return 1


def _interpreter_shutdown():
    """What interpreter exit does for a program: join its non-daemon threads, run its
    atexit functions, flush the standard streams."""
    import atexit

    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except BaseException:
            _report_exception()
    atexit._run_exitfuncs()
    _flush_standard_streams()


def _flush_standard_streams():
    """Flush what the code printed (also when it replaced sys.stdout), whatever it did to them."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:
            pass


def _done(status_fd, exit_code, signal_number=0, cpu_s=0.0):
    try:
        posix.write(status_fd, b"D%d %d %.3f\n" % (exit_code, signal_number, cpu_s))
    except OSError:
        pass


def _run_python(request):
    workspace = request["workspace"]
    path = workspace + "/" + request["script"]
    sys.argv = [request["script"]] + list(request["argv"])
    sys.path.insert(0, workspace)  # `-I` leaves the script's directory off sys.path
    exit_code = 0
    try:
        code = compile(request["code"], path, "exec")
        exec(code, _fresh_main_namespace(path))
    except SystemExit as e:
        exit_code = _system_exit_code(e)
    except BaseException:
        _report_exception()
        exit_code = 1
    _interpreter_shutdown()
    posix._exit(exit_code)


def _exec(argv):
    """execvp: the first PATH entry that holds argv[0]; on failure exit as a shell would."""
    env = posix.environ
    name = argv[0]
    if "/" in name:
        candidates = [name]
    else:
        search = env.get(b"PATH", b"/usr/bin:/bin").decode()
        candidates = [d + "/" + name for d in search.split(":") if d]
    error = None
    for candidate in candidates:
        try:
            posix.execve(candidate, argv, env)
        except OSError as e:
            if error is None or not isinstance(e, FileNotFoundError):
                error = e
    message = f"sandbox: cannot execute {name!r}: {error.strerror if error else 'not found'}\n"
    posix.write(2, message.encode())
    posix._exit(127 if error is None or isinstance(error, FileNotFoundError) else 126)


def _set_dumpable(value):
    """prctl(PR_SET_DUMPABLE): a process that is not dumpable cannot be ptraced by another
    process of the same uid. Only needed without the syscall filter (which denies ptrace
    outright); `_ctypes` directly, as `ctypes` costs 3 ms to import."""
    import _ctypes

    class _Int(_ctypes._SimpleCData):
        _type_ = "i"

    class _Function(_ctypes.CFuncPtr):
        _flags_ = _ctypes.FUNCFLAG_CDECL
        _restype_ = _Int

    prctl = _Function(_ctypes.dlsym(_ctypes.dlopen(None), "prctl"))
    if prctl(4, value, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError("prctl(PR_SET_DUMPABLE) failed")


def _supervise(pid, status_fd):
    """Wait for the code's process and report how it ended. This process is the sandbox's
    init (bubblewrap's --as-pid-1): the kernel keeps every signal from inside the sandbox
    away from it (its handlers are the defaults), /proc/1 is masked (its descriptors and
    memory cannot be opened; without the syscall filter, which denies ptrace, it is also
    made non-dumpable), it alone holds the status pipe once the code runs, and it reports
    the kernel's own account of the child's end (wait4), so nothing the code does can
    change the report or stop it. As init it also reaps the orphans the code leaves."""
    import _signal

    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)  # as init, default handlers make it immune
    while True:
        reaped, status, usage = posix.wait4(-1, 0)
        if reaped == pid:
            break
    cpu_s = usage.ru_utime + usage.ru_stime
    if posix.WIFSIGNALED(status):
        signal_number = posix.WTERMSIG(status)
        _done(status_fd, -1, signal_number, cpu_s)
        posix._exit(128 + signal_number)
    exit_code = posix.WEXITSTATUS(status)
    _done(status_fd, exit_code, 0, cpu_s)
    posix._exit(exit_code)


def _run_session_turn(code, namespace):
    """One turn of a Python session: like a notebook cell, a final bare expression is shown."""
    import ast

    try:
        tree = ast.parse(code, "<turn>", "exec")
        last_expr = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last_expr = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<turn>", "exec"), namespace)
        if last_expr is not None:
            value = eval(compile(last_expr, "<turn>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit:
        raise
    except BaseException:
        _report_exception()
        return 1
    return 0


def _python_session(request_fd, workspace):
    import _signal

    sys.path.insert(0, workspace)
    namespace = _fresh_main_namespace("<session>")
    idle_timeout_s = 0
    while True:
        _signal.alarm(idle_timeout_s)  # an abandoned session ends by itself
        turn = _read_frame(request_fd)
        _signal.alarm(0)
        if turn is None:
            return 0
        idle_timeout_s = turn["idle_timeout_s"]
        rc = _run_session_turn(turn["code"], namespace)
        _flush_standard_streams()
        token = turn["token"].encode()
        _write_all(1, b"\n" + token + b":" + str(rc).encode() + b"\n")
        _write_all(2, b"\n" + token + b"\n")


def main():
    import _signal

    request_fd, status_fd, idle_timeout_s = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    undumpable = sys.argv[4] == "1"
    forks = sys.argv[5] == "1"  # else the native supervisor (_supervisor.c) is this process's parent
    if undumpable:
        try:
            _set_dumpable(0)
        except BaseException as e:
            posix.write(status_fd, f"Ecannot make the sandbox runner non-dumpable: {type(e).__name__}: {e}\n".encode())
            return 125
    # Without the native supervisor (tidal/sandbox/supervisor.py), forked before the request
    # comes (while the sandbox is warm): this process supervises, the child becomes the code's
    # process. The child's writes to pages the two share are copied then, and two interpreters
    # are torn down at the end (measured: ~3 ms of CPU per run more than with the native one).
    pid = posix.fork() if forks else 0
    if pid:
        posix.close(request_fd)
        return _supervise(pid, status_fd)
    if undumpable:
        _set_dumpable(1)  # the code's own process behaves as usual towards itself
    _signal.alarm(idle_timeout_s)  # a warm sandbox nobody takes ends by itself
    request = _read_frame(request_fd)
    _signal.alarm(0)
    if request is None:
        return 0
    try:
        _set_up(request)
    except BaseException as e:
        posix.write(status_fd, f"E{type(e).__name__}: {e}".replace("\n", " ").encode()[:4000] + b"\n")
        return 125
    posix.write(status_fd, b"S")
    posix.close(status_fd)  # from here on only the supervisor holds it
    if request["mode"] == "python_session":
        return _python_session(request_fd, request["workspace"])
    posix.close(request_fd)
    if request["mode"] == "python":
        _run_python(request)
    _exec(list(request["argv"]))


if __name__ == "__main__":
    sys.exit(main())
