"""How a sandbox process is started: the bubblewrap command line, or the unsafe host one.

The sandbox sees only what is bound into it: /usr (with the /bin, /lib… links of a
merged-/usr system), the two pieces of /etc that programs need to start (the dynamic
linker cache, alternatives), five harmless devices, the interpreter's own installation
prefix, and the paths the config lists, all read-only. / is a read-only tmpfs, /tmp and
/workspace are private tmpfs of bounded size, /proc belongs to the sandbox's own PID
namespace (with /proc/1, the supervisor, masked). Every namespace is new (user,
mount, PID, network with only its own loopback, IPC, UTS, cgroup) and nested user
namespaces are refused.

When tidal runs as root, bubblewrap is started as an unprivileged uid (by the starter
thread switching its own user, `thread_user`, or else through `setpriv`): bubblewrap then
creates a user namespace, whose process count is what RLIMIT_NPROC limits (host root would
be exempt from it). An interpreter under a directory that uid cannot
read (pyenv under /root, mode 700) is not used; the system one is.

The sandbox's init is the native supervisor where it can be built (`supervisor`): the
command then runs it, and it runs the runner.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tidal.sandbox import supervisor, thread_user
from tidal.sandbox.config import SandboxConfig, SandboxLimits
from tidal.sandbox.result import SandboxUnavailable
from tidal.sandbox.supervisor import readable_by

RUNNER_SOURCE = (Path(__file__).with_name("_runner.py")).read_text()
# Started with `-c`: reads the runner's code object (the first frame on the request pipe,
# compiled once per interpreter) and runs it; compiling the runner's source instead would
# cost every run a millisecond and a half.
BOOTSTRAP = ("import marshal,posix,sys\n"
             "def _read(fd,n):\n"
             " b=b''\n"
             " while len(b)<n:\n"
             "  c=posix.read(fd,n-len(b))\n"
             "  if not c:raise SystemExit(0)\n"
             "  b+=c\n"
             " return b\n"
             "_fd=int(sys.argv[1])\n"
             "exec(marshal.loads(_read(_fd,int.from_bytes(_read(_fd,8),'little'))))\n")
WORKSPACE = "/workspace"
# Of /etc only what ordinary programs need to start: the dynamic linker's cache and the
# alternatives links some /usr/bin commands point through (awk, editor…).
ETC_PATHS = ("/etc/ld.so.cache", "/etc/alternatives")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
MERGED_USR_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
# Where host services keep their unix sockets (and other users their files): wherever a bind
# would show one of these, an empty read-only tmpfs covers it (`mask_host_sockets`).
# Connecting to a socket needs write permission on its inode, not a writable mount, so a
# read-only bind alone does not stop a run from talking to a host service.
SOCKET_DIRS = ("/run", "/var/run", "/tmp", "/var/tmp", "/dev/shm", "/var/lib/docker", "/var/lib/containerd",
               "/var/lib/kubelet", "/var/spool", "/home", "/root")


def python_flags(site_packages: bool) -> list[str]:
    """Interpreter flags of every sandboxed Python (and of the benchmark's bare baseline):
    isolated mode (no PYTHON* variables, no user site, no script dir on sys.path), no
    bytecode files written; `-S` unless site-packages were asked for."""
    return ["-I", "-B"] + ([] if site_packages else ["-S"])


@dataclass(frozen=True)
class SandboxPython:
    executable: str
    prefixes: tuple[str, ...]  # installation directories to bind (outside /usr)
    runner_frame: bytes  # the runner compiled by this interpreter, framed for the request pipe


@dataclass
class Launch:
    """A command line that starts the runner, and what belongs to that one start."""

    argv: list[str]
    env: dict[str, str]
    runner_frame: bytes  # to write first on the request pipe
    workspace: str  # the workspace as the runner sees it
    host_workspace: str | None  # unsafe_host only: the host directory to remove afterwards
    isolated: bool
    run_as: tuple[int, int] | None = None  # (uid, gid) the starter thread takes to start it


def _runs_as_root() -> bool:
    return os.geteuid() == 0


def uid_pool_in_use(config: SandboxConfig) -> bool:
    """Whether each sandbox gets a uid of its own (`uids`): as root, with a pool configured."""
    return config.isolation == "bwrap" and _runs_as_root() and config.uid_pool_size > 0


def sandbox_uid(config: SandboxConfig) -> int:
    """The uid sandboxes run as (with a uid pool: its first, which stands for all of them in
    permission checks: no host file belongs to a pool uid)."""
    if not _runs_as_root():
        return os.geteuid()
    return config.uid_pool_start if uid_pool_in_use(config) else config.sandbox_uid


@functools.lru_cache(maxsize=8)
def _describe_python(executable: str) -> SandboxPython:
    out = subprocess.run([executable, "-I", "-S", "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
                         capture_output=True, text=True, timeout=30, check=False)
    if out.returncode != 0:
        raise SandboxUnavailable(f"sandbox interpreter {executable} does not start: {out.stderr.strip()[-500:]}")
    prefixes = {os.path.realpath(p) for p in out.stdout.split()}
    outside_usr = tuple(sorted(p for p in prefixes if not (p == "/usr" or p.startswith("/usr/"))))
    compiled = subprocess.run(
        [executable, "-I", "-S", "-c", ("import marshal,sys;sys.stdout.buffer.write(marshal.dumps("
                                        "compile(sys.stdin.read(),'<tidal-sandbox-runner>','exec')))")],
        input=RUNNER_SOURCE.encode(), capture_output=True, timeout=30, check=False)
    if compiled.returncode != 0:
        raise SandboxUnavailable(f"sandbox interpreter {executable} cannot compile the sandbox runner: "
                                 f"{compiled.stderr.decode(errors='replace').strip()[-500:]}")
    frame = len(compiled.stdout).to_bytes(8, "little") + compiled.stdout
    return SandboxPython(executable, outside_usr, frame)


def resolve_python(config: SandboxConfig) -> SandboxPython:
    """The interpreter for sandboxed Python: the configured one, else the base interpreter
    of this process (never its virtualenv), else /usr/bin/python3 — the first one the
    sandbox uid can read."""
    uid = sandbox_uid(config) if config.isolation == "bwrap" else os.geteuid()
    if config.python is not None:
        candidates = [config.python]
    else:
        base = getattr(sys, "_base_executable", None) or sys.executable
        candidates = [os.path.realpath(base), "/usr/bin/python3"]
    for candidate in candidates:
        path = shutil.which(candidate) or candidate
        if os.path.exists(path) and readable_by(path, uid):
            described = _describe_python(os.path.realpath(path))
            if all(readable_by(p, uid) for p in described.prefixes):
                return described
    raise SandboxUnavailable(
        f"no Python interpreter readable by the sandbox uid {uid} among {candidates}; set sandbox.python "
        "to an interpreter outside private home directories (e.g. /usr/bin/python3)")


def find_bwrap(config: SandboxConfig) -> str:
    path = shutil.which(config.bwrap)
    if path is None:
        raise SandboxUnavailable(
            f"bubblewrap (`{config.bwrap}`) is not installed, so untrusted code cannot be isolated. Install it "
            "(`apt-get install bubblewrap`; scripts/setup.sh does this as root), or set "
            "sandbox.isolation=unsafe_host to run untrusted code on this host without isolation.")
    return path


# Kernel filesystems: no host socket lives there, and walking them takes long.
NOT_SCANNED = ("/proc", "/sys", "/dev")


def host_sockets(roots: list[str]) -> list[str]:
    """Every unix socket under `roots` (symlinks not followed; /proc, /sys and /dev
    skipped), through `find` where it is installed (three times faster than a Python walk
    over /usr: it reads each entry's type from the directory, without a stat)."""
    roots = [r for r in roots if os.path.lexists(r) and not any(r == n or r.startswith(n + "/") for n in NOT_SCANNED)]
    if not roots:
        return []
    find = shutil.which("find")
    if find is not None:
        prune = [arg for n in NOT_SCANNED for arg in ("-path", n, "-o")][:-1]
        out = subprocess.run([find, "-P", *roots, "(", *prune, ")", "-prune", "-o", "-type", "s", "-print0"],
                             capture_output=True, timeout=300, check=False)
        return sorted(p for p in out.stdout.decode(errors="surrogateescape").split("\0") if p)
    found, stack = [], list(roots)
    while stack:
        path = stack.pop()
        if _is_socket(path):
            found.append(path)
            continue
        try:
            with os.scandir(path) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        if entry.path not in NOT_SCANNED:
                            stack.append(entry.path)
                    elif not (entry.is_file(follow_symlinks=False) or entry.is_symlink()) and _is_socket(entry.path):
                        found.append(entry.path)
        except OSError:  # not a directory, not readable, gone
            continue
    return sorted(found)


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


@functools.lru_cache(maxsize=16)
def _socket_masks(bound: tuple[str, ...]) -> tuple[str, ...]:
    """bubblewrap arguments that hide the host's sockets under the bound paths: an empty
    read-only tmpfs over each socket directory a bind would show, and /dev/null over every
    other socket found there now (one created later, outside those directories, would be
    reachable if its permissions let the sandbox uid write it: docs/sandbox.md)."""
    args = []
    roots = [os.path.realpath(p) for p in bound]
    masked = sorted({d for d in SOCKET_DIRS for r in roots
                     if (d == r or d.startswith(r.rstrip("/") + "/")) and os.path.isdir(d) and not os.path.islink(d)})
    for directory in masked:
        args += ["--tmpfs", directory, "--remount-ro", directory]
    for sock in host_sockets(roots):
        if not any(sock.startswith(d + "/") for d in masked):
            args += ["--ro-bind", "/dev/null", sock]
    return tuple(args)


def _mount_args(config: SandboxConfig, python: SandboxPython, limits: SandboxLimits,
                native_supervisor: str | None) -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for link in MERGED_USR_LINKS:
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
    site_config = sorted(glob.glob("/etc/python3*")) if config.python_site_packages else []
    for path in [*ETC_PATHS, *site_config]:
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    binds = [*python.prefixes, *config.extra_ro_binds, *([native_supervisor] if native_supervisor else [])]
    for path in binds:
        args += ["--ro-bind", path, path]
    if config.mask_host_sockets:
        args += _socket_masks(("/usr", *ETC_PATHS, *site_config, *binds))
    for device in DEVICES:  # cheaper than --dev, and no /dev/pts, /dev/shm
        args += ["--dev-bind", device, device]
    # /proc/1 is the supervisor, which reports the run's result: an empty read-only
    # tmpfs over it keeps the code (same uid) from opening its descriptors or memory there.
    args += ["--proc", "/proc", "--tmpfs", "/proc/1", "--remount-ro", "/proc/1",
             "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp",
             "--size", str(limits.workspace_bytes), "--tmpfs", WORKSPACE,
             # bwrap's own root is a tmpfs without a size: writable, it would let the code
             # fill the host's memory.
             "--remount-ro", "/"]
    return args


def _sandbox_env(config: SandboxConfig, workspace: str, tmp: str) -> dict[str, str]:
    return {"PATH": SANDBOX_PATH, "HOME": workspace, "TMPDIR": tmp, "LANG": "C.UTF-8", **config.env}


def prepare(config: SandboxConfig) -> None:
    """Build (and cache) the command line of the config's default limits now: the first
    build walks the bound paths for host sockets (about a second over /usr), which a pool
    does when it starts rather than in its first run."""
    if config.isolation == "bwrap":
        _command(config.model_dump_json(), config.limits.tmp_bytes, config.limits.workspace_bytes)


def build_launch(config: SandboxConfig, limits: SandboxLimits, request_fd: int, status_fd: int,
                 bwrap_fds: dict[str, int] | None = None, uid: int | None = None) -> Launch:
    """The command that starts one runner, reading its request from `request_fd` and
    reporting set-up on `status_fd` (both inherited at the same numbers). `bwrap_fds` are
    bubblewrap's own descriptors by option (`seccomp`, `json-status-fd`, `block-fd`); `uid`
    the host uid this sandbox runs as, when tidal runs as root (default: `sandbox_uid`)."""
    head, tail, runner_frame, switch, native = _command(config.model_dump_json(), limits.tmp_bytes,
                                                        limits.workspace_bytes)
    run_as = None
    if switch is not None:
        uid = config.sandbox_uid if uid is None else uid
        if switch == "thread":
            run_as = (uid, uid)
        else:  # the path of setpriv
            head = (switch, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *head)
    # Make the supervisor non-dumpable (proof against ptrace), needed only where no syscall
    # filter denies ptrace; the runner's last argument: whether it forks its own supervisor.
    undumpable = "1" if config.isolation == "bwrap" and not config.seccomp else "0"
    runner_args = [str(request_fd), str(status_fd), str(config.idle_timeout_s), "0" if native else undumpable,
                   "0" if native else "1"]
    if native:
        tail = ("--", native, str(status_fd), str(request_fd), undumpable, *tail)
    if config.isolation == "unsafe_host":
        workspace = tempfile.mkdtemp(prefix="tidal-sandbox-unsafe-")
        return Launch([*head, *tail, *runner_args], _sandbox_env(config, workspace, workspace), runner_frame,
                      workspace, workspace, isolated=False)
    options = [arg for option, fd in (bwrap_fds or {}).items() for arg in (f"--{option}", str(fd))]
    host_env = {"PATH": os.environ.get("PATH", SANDBOX_PATH), "LANG": "C.UTF-8"}
    return Launch([*head, *options, *tail, *runner_args], host_env, runner_frame, WORKSPACE, None, isolated=True,
                  run_as=run_as)


@functools.lru_cache(maxsize=32)
def _command(config_json: str, tmp_bytes: int, workspace_bytes: int
             ) -> tuple[tuple[str, ...], tuple[str, ...], bytes, str | None, str | None]:
    """The command line, split where bubblewrap's per-start options go, up to the runner's
    own arguments (the same for every sandbox of a config: built once, it spares each
    start a few dozen stat calls), how it changes user when tidal runs as root ("thread":
    the starter thread switches itself; else the path of `setpriv`; None: it does not), and
    the native supervisor, if there is one (`supervisor`)."""
    config = SandboxConfig.model_validate_json(config_json)
    python = resolve_python(config)
    runner = [python.executable, *python_flags(config.python_site_packages), "-c", BOOTSTRAP]
    if config.isolation == "unsafe_host":
        return tuple(runner), (), python.runner_frame, None, None
    limits = config.limits.updated({"tmp_bytes": tmp_bytes, "workspace_bytes": workspace_bytes})
    native = supervisor.binary(sandbox_uid(config)) if config.native_supervisor else None
    argv = [find_bwrap(config), *_mount_args(config, python, limits, native),
            "--unshare-user", "--unshare-all", "--disable-userns", "--as-pid-1",
            "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
    for name, value in _sandbox_env(config, WORKSPACE, "/tmp").items():
        argv += ["--setenv", name, value]
    argv += ["--chdir", WORKSPACE]
    if uid_pool_in_use(config):
        # Inside, every sandbox is the same user whatever pool uid it runs as outside: what a
        # program sees (`ls -l`, `id`) does not depend on which uid it was given.
        argv += ["--uid", str(config.sandbox_uid), "--gid", str(config.sandbox_uid)]
    switch = None
    if _runs_as_root() and thread_user.available():
        switch = "thread"
    elif _runs_as_root():
        switch = shutil.which("setpriv")
        if switch is None:
            raise SandboxUnavailable("tidal runs as root and `setpriv` (util-linux) is missing: it is needed to start "
                                     "bubblewrap as an unprivileged uid")
    return tuple(argv), ("--", *runner), python.runner_frame, switch, native
