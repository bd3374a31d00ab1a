"""The page-cache channel between two sandbox runs: how many bits per second it carries.

    python benchmarks/page_cache_channel.py [--bits 512] [--rounds 3] [--file PATH]

Runs share the host's page cache for the read-only files bound into them (/usr, the
interpreter). One run (the sender) reads the pages of a shared file that stand for its 1
bits; a later run (the receiver) touches every page and counts its own major page faults
(`getrusage`): a page that needed no disk read was cached, so someone read it. Neither the
syscall filter nor the namespaces can see a page fault, so this probe is still open after
the filter refused the precise ones (preadv2 RWF_NOWAIT, posix_fadvise DONTNEED; mincore
and cachestat answer nothing useful about files a run cannot write, by the kernel's own
rule). What is left is measured here, as the sandboxes run it, with tidal's defaults.

The receiver's read sets every bit to 1 and the sender cannot evict pages again (DONTNEED is
a no-op in the sandbox), so each page carries one bit once, until the host's memory
pressure evicts it. The host (root) evicts the file before each round, standing in for a
file nobody has read lately. Pages are STRIDE apart with readahead off (MADV_RANDOM), so a
fault reads one page and never its neighbours. Bandwidth = bits × (1 − H(error rate)) ÷
(the sender's time + the receiver's time), each measured inside its run (sandbox start-up
excluded: it is paid by every run anyway); also given with the two runs' wall clocks.
Prints a Markdown row per round and writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

from tidal.sandbox import SandboxConfig, run_python_sync

STRIDE_PAGES = 16  # 64 KiB apart: one fault never brings in a neighbour's page (readahead is off too)
PAGE = 4096

COMMON = """
import ctypes, mmap, os, resource, time
fd = os.open(FILE, os.O_RDONLY)
m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
m.madvise(mmap.MADV_RANDOM)
"""
SENDER = COMMON + """
t0 = time.perf_counter()
for i, bit in enumerate(BITS):
    if bit:
        m[i * STRIDE]  # reading the byte faults the page in
print(time.perf_counter() - t0)
"""
RECEIVER = COMMON + """
t0 = time.perf_counter()
out = []
for i in range(len(BITS_LEN)):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    m[i * STRIDE]
    out.append(int(resource.getrusage(resource.RUSAGE_SELF).ru_majflt == before))
print(time.perf_counter() - t0)
print("".join(map(str, out)))
"""


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _entropy(p: float) -> float:
    return 0.0 if p in (0.0, 1.0) else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def _pick_file(bits: int) -> str:
    """A large regular file under /usr/lib that every sandbox can read."""
    need = bits * STRIDE_PAGES * PAGE
    for root, _, files in os.walk("/usr/lib"):
        for name in files:
            path = os.path.join(root, name)
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                continue
            if st.st_size >= need and st.st_mode & 0o004 and os.path.isfile(path) and not os.path.islink(path):
                return path
    raise SystemExit(f"no readable file of {need} bytes under /usr/lib")


def one_round(path: str, bits: int, config: SandboxConfig) -> dict:
    message = [random.getrandbits(1) for _ in range(bits)]
    _evict(path)
    head = f"FILE = {path!r}\nSTRIDE = {STRIDE_PAGES * PAGE}\n"
    t0 = time.monotonic()
    sent = run_python_sync(head + f"BITS = {message!r}\n" + SENDER, config, limits={"wall_s": 120})
    got = run_python_sync(head + f"BITS_LEN = range({bits})\n" + RECEIVER, config, limits={"wall_s": 120})
    t2 = time.monotonic()
    for r in (sent, got):
        if not r.ok:
            raise SystemExit(f"a run failed: {r.status} {r.stderr[-500:]}")
    send_s = float(sent.stdout.split()[0])
    recv_s, decoded = float(got.stdout.split()[0]), got.stdout.split()[1]
    errors = sum(int(a) != b for a, b in zip(decoded, message, strict=True))
    p = errors / bits
    carried = bits * (1 - _entropy(p))
    return {"bits": bits, "errors": errors, "error_rate": p, "send_s": send_s, "receive_s": recv_s,
            "bits_per_s": carried / (send_s + recv_s), "bits_per_s_with_runs": carried / (t2 - t0),
            "runs_wall_s": t2 - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bits", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--file", help="the shared file (default: the first large enough under /usr/lib)")
    p.add_argument("--out", help="write the rounds as JSON here")
    ns = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the host evicts the shared file before each round")
    path = ns.file or _pick_file(ns.bits)
    config = SandboxConfig(warm=0)
    rounds = [one_round(path, ns.bits, config) for _ in range(ns.rounds)]
    print(f"file {path}, {ns.bits} bits per round, pages {STRIDE_PAGES * PAGE} bytes apart\n")
    print("| round | errors | send | receive | bits/s (in-run time) | bits/s (with both runs' wall clock) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for i, r in enumerate(rounds, 1):
        print(f"| {i} | {r['errors']}/{r['bits']} | {r['send_s'] * 1000:.1f} ms | {r['receive_s'] * 1000:.1f} ms | "
              f"{r['bits_per_s']:.0f} | {r['bits_per_s_with_runs']:.0f} |")
    print(f"\nmedian: {statistics.median(r['bits_per_s'] for r in rounds):.0f} bits/s in-run, "
          f"{statistics.median(r['bits_per_s_with_runs'] for r in rounds):.0f} bits/s with the runs' wall clock")
    if ns.out:
        Path(ns.out).write_text(json.dumps({"file": path, "stride_bytes": STRIDE_PAGES * PAGE, "rounds": rounds,
                                            "python": sys.version.split()[0]}, indent=1))


if __name__ == "__main__":
    main()
