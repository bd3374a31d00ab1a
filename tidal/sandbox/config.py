"""Typed settings of the sandbox: the limits of one run and the pool that runs them.

`SandboxLimits` is what one execution may use; a call may override any of its fields.
`SandboxConfig` chooses the isolation, the interpreter, the concurrency and the number of
warm (pre-started) sandboxes. Isolation defaults to bubblewrap; the only alternative is
named `unsafe_host` so that nobody turns isolation off by accident.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MiB = 1 << 20


class SandboxLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_s: float = Field(10.0, gt=0.0, description="Wall-clock bound of one run (of one turn in a session); past it every process of the sandbox is killed and the status is `timeout`.")
    cpu_s: int = Field(10, ge=1, description="CPU seconds (RLIMIT_CPU) of each process; reaching it ends the process with SIGXCPU, status `timeout`. In a session it counts over the whole session.")
    memory_bytes: int = Field(1024 * MiB, ge=64 * MiB, description="Memory of the whole run: the limit of its cgroup (anonymous memory, memfds, the pages of its /workspace and /tmp, kernel memory of its files; reaching it gets a process OOM-killed, status `memory`), and the address space of each process (RLIMIT_AS; exceeding it fails allocations, status `memory`). Threads reserve stack and malloc arenas against the address space.")
    cpus: float = Field(1.0, gt=0.0, le=4096.0, description="CPU of the whole run, in cores' worth of time per 100 ms period (its cgroup's CFS quota: cpu.cfs_quota_us on v1, cpu.max on v2), whatever number of processes or threads it starts; a session's between its turns is none (its cgroup is frozen). Where the cpu controller is missing, a warning once and only cpu_s per process bounds it (require_cgroups refuses instead).")
    max_processes: int = Field(64, ge=4, description="Processes and threads alive at once inside the sandbox, its own init included (its cgroup's pids.max, and RLIMIT_NPROC in the sandbox's user namespace).")
    max_open_files: int = Field(256, ge=16, description="Open file descriptors per process (RLIMIT_NOFILE).")
    output_bytes: int = Field(1 * MiB, ge=1024, description="Bytes kept of stdout and of stderr each; more ends the run, status `output_limit`.")
    file_bytes: int = Field(64 * MiB, ge=4096, description="Largest file a process may write (RLIMIT_FSIZE); status `output_limit` when hit.")
    workspace_bytes: int = Field(128 * MiB, ge=1 * MiB, description="Size of the private /workspace (a tmpfs; the host disk is never written). Full: status `output_limit`.")
    tmp_bytes: int = Field(64 * MiB, ge=1 * MiB, description="Size of the private /tmp (a tmpfs).")

    def updated(self, overrides: dict[str, Any] | None) -> SandboxLimits:
        """These limits with some fields replaced, validated like the originals."""
        if not overrides:
            return self
        return SandboxLimits.model_validate({**self.model_dump(), **overrides})


class SandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    isolation: Literal["bwrap", "unsafe_host"] = Field("bwrap", description="`bwrap`: bubblewrap namespaces (no network, read-only system, private /tmp and workspace, own PID namespace). `unsafe_host`: run untrusted code directly on the host with rlimits only; logs a warning on every run. Without bwrap, tidal refuses to run code unless this is `unsafe_host`.")
    limits: SandboxLimits = Field(default_factory=SandboxLimits, description="Default limits of every run; a call may override fields.")
    max_concurrency: int = Field(2, ge=1, description="Runs (and session turns) executing at once; further calls wait for a slot.")
    warm: int = Field(4, ge=0, description="Sandboxes started ahead of need (on idle cores, off the event loop), so that a run skips the sandbox and interpreter start-up; about 4 per concurrent run keeps up with back-to-back short runs. 0: start each on demand.")
    idle_timeout_s: int = Field(300, ge=1, description="A warm sandbox, or a session, that receives no work for this long exits by itself.")
    python: str | None = Field(None, description="Interpreter run inside the sandbox. None: the base interpreter of the running Python if the sandbox user can read it, else /usr/bin/python3. Its installation prefix is bound read-only.")
    python_site_packages: bool = Field(False, description="Let sandboxed Python import from its site-packages (costs start-up time). False: standard library only (`-S`).")
    extra_ro_binds: list[str] = Field(default_factory=list, description="More host paths bound read-only at the same place inside (e.g. a virtualenv with numpy). Nothing else of the host is visible.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables of sandboxed programs (the host environment is never passed in).")
    sandbox_uid: int = Field(65534, ge=1, description="When tidal runs as root and uid_pool_size is 0: the one unprivileged host uid that bubblewrap and every sandbox run as (root would exempt them from the process limit). Then the kernel's per-user quotas (inotify instances, pipe buffers, POSIX message queues, user namespaces) are shared by all sandboxes.")
    uid_pool_start: int = Field(0x70000000, ge=1000, description="When tidal runs as root: the first of the uids handed out one per live sandbox (uid = gid), so that no sandbox shares the kernel's per-user quotas with another, nor with the host. The default, 1879048192 (0x70000000), lies above systemd's ranges for system, dynamic and container users; the range must be reserved for tidal (no host files or processes of these uids).")
    uid_pool_size: int = Field(4096, ge=0, description="How many uids from uid_pool_start the sandboxes of this machine may use at once (warm ones and sessions included; tidal processes on one machine share the range through lock files). Exhausted: starting a sandbox fails with an error saying so. 0: every sandbox runs as sandbox_uid (shared per-user quotas).")
    bwrap: str = Field("bwrap", description="The bubblewrap executable (a name looked up on PATH, or a path).")
    seccomp: bool = Field(True, description="Install the syscall filter (tidal/sandbox/seccomp.py) in every sandbox; without libseccomp nothing runs. False: no filter (ptrace, keyrings, io_uring, bpf… stay reachable; docs/sandbox.md).")
    native_supervisor: bool = Field(True, description="The sandbox's init is a small C program (tidal/sandbox/_supervisor.c, built once with the system's C compiler) that starts the runner as a fresh process; where it cannot be built, a warning once and the runner supervises itself as with False. False: the runner forks and its parent supervises (a few ms of CPU more per run; the same guarantees).")
    cgroups: bool = Field(True, description="Give each run its own cgroup (memory, pids, and where available cpu and freezer; under this process's own cgroup) and tear runs down through it; where none can be made, or a controller is missing, a warning once and rlimits bound what it would have. False: never.")
    require_cgroups: bool = Field(False, description="Refuse to run (SandboxUnavailable, naming what is missing) unless every run gets a cgroup with all four controllers: memory, pids, cpu (the `cpus` quota) and freezer (idle sessions stopped), and, on cgroup v1, the limit of TCP/UDP buffers (memory.kmem.tcp.limit_in_bytes). False: a missing one is a warning, once.")
    mask_host_sockets: bool = Field(True, description="Hide the host's unix sockets from the read-only binds: the usual socket directories (/run, /var/run, /tmp, /var/tmp, /dev/shm, /var/lib/docker…) under a bound path become empty, and every socket found under a bound path when the pool starts is covered with /dev/null (connecting to a socket needs no write access to the mount, so a read-only bind does not protect it). False: binds show them as the host has them.")

    @model_validator(mode="after")
    def _uid_range(self) -> SandboxConfig:
        end = self.uid_pool_start + self.uid_pool_size
        if self.uid_pool_size and end > 0xFFFFFFFF:  # (uid_t)-1 is no uid
            raise ValueError(f"sandbox.uid_pool_start + uid_pool_size = {end} passes the last uid, 4294967294")
        if self.uid_pool_size and self.uid_pool_start <= self.sandbox_uid < end:
            raise ValueError(f"sandbox.sandbox_uid ({self.sandbox_uid}) lies in the uid pool "
                             f"[{self.uid_pool_start}, {end}): host files of that user would be the sandboxes'")
        return self
