"""The program that runs inside every sandbox, before and around the untrusted code.

It is started before its work is known (that is what makes a warm sandbox possible) and
blocks on the request pipe. The host sends it compiled (by the sandbox's own interpreter,
so the bytecode always matches) and starts it with a one-line bootstrap. On a request it
materializes files and stdin, sets the resource limits, writes "S" on the status pipe and
runs the code. The host learns that the code is done from bubblewrap's exit, which follows
this process's own exit; for a command this process also writes "D<exit code> <signal>
<cpu seconds>" (the exact signal and CPU time, which the 128+N exit status cannot tell
apart from a chosen exit code; the host uses it only where it agrees with that status).

Modes of a request:
- `python`: run `code` as the `__main__` of this interpreter (no second interpreter start);
  at its end, as at interpreter exit: non-daemon threads are joined, atexit runs.
- `exec`: fork the command and wait for it (its exact signal and CPU time are reported,
  which bubblewrap's 128+N exit code cannot tell apart from a chosen exit code).
- `python_session`: keep one `__main__` namespace and run one code chunk per frame read
  from the request pipe, ending each turn's stdout and stderr with a token line.

Only built-in modules (`posix`, not `os`: importing `os` alone costs a millisecond per
run), and `resource`. In `python` mode the status pipe is closed before the code runs
(the code runs in this process); in `exec` mode the command never holds it.
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


def _run_exec(request, status_fd):
    argv = list(request["argv"])
    pid = posix.fork()
    if pid == 0:
        posix.close(status_fd)
        _exec(argv)
    _, status, usage = posix.wait4(pid, 0)
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
    _signal.alarm(idle_timeout_s)  # a warm sandbox nobody takes ends by itself
    request = _read_frame(request_fd)
    _signal.alarm(0)
    if request is None:
        return 0
    try:
        _set_up(request)
    except BaseException as e:
        posix.write(status_fd, f"E{type(e).__name__}: {e}".encode()[:4000])
        return 125
    posix.write(status_fd, b"S")
    mode = request["mode"]
    if mode == "python_session":
        posix.close(status_fd)
        return _python_session(request_fd, request["workspace"])
    posix.close(request_fd)
    if mode == "python":
        # The code runs in this process: it must not hold the status pipe (the host takes the
        # end of the run from bubblewrap's exit, the set-up report "S" was sent before).
        posix.close(status_fd)
        return _run_python(request)
    return _run_exec(request, status_fd)


if __name__ == "__main__":
    sys.exit(main())
