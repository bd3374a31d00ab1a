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

The code is in four parts that run in the sandbox as one script (PARTS, joined and compiled
by tidal.rewards.code): _code_wire.py (frames, values, the peer both sides are),
_code_proxy.py (G's handles to the program's objects, and the Grader peer), _code_program.py
(S), and this file, the harness: start S, hide G, run the tests, say the verdict. On the
host each part is a module that imports the parts before it (tests read them so).
"""
# ruff: noqa: S102, BLE001 — running the tests, and outliving whatever the program raises, is this file's job.

import builtins
import os
import sys

if __name__ != "__main__":  # imported on the host; in the sandbox the parts run as one script
    from tidal.rewards._code_program import server_main
    from tidal.rewards._code_proxy import Grader
    from tidal.rewards._code_wire import ProtocolError, receive

PR_SET_DUMPABLE, PR_GET_DUMPABLE = 4, 3
COMPILED_NAME = "_tidal_grader.bin"  # the PARTS compiled (marshal), beside main.py in the workspace
# The parts of the sandbox's script, in order (tidal.rewards.code joins them): each part uses
# only the names of the parts before it, and this one, last, starts the side it is run as.
PARTS = ("_code_wire.py", "_code_proxy.py", "_code_program.py", "_code_grader.py")


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
        ready = receive(grader.read_fd)
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


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        server_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        grader_main()
