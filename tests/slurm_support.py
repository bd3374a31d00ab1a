"""Shared by the Slurm tests: a one-node Slurm cluster on this machine (scripts/setup_slurm.sh),
and the processes of a job's Ray cluster.

The tests skip only where Slurm is absent and could not have been installed (not root, or no
apt-get); where the script could have installed it, or with TIDAL_REQUIRE_SLURM=1, a cluster
that does not come up is a failure, so CI never passes by skipping them."""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
from pathlib import Path

import psutil
import pytest

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup_slurm.sh"
NOT_INSTALLABLE = 3  # setup_slurm.sh's exit code: missing, and this machine cannot install it


def require_slurm() -> None:
    out = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=600, check=False)
    if out.returncode == 0:
        return
    if out.returncode == NOT_INSTALLABLE and os.environ.get("TIDAL_REQUIRE_SLURM") != "1":
        pytest.skip(f"Slurm is not installed and cannot be here: {out.stderr.strip()} "
                    "(TIDAL_REQUIRE_SLURM=1 makes this a failure)")
    pytest.fail(f"scripts/setup_slurm.sh could not start a one-node Slurm cluster (exit {out.returncode}): "
                f"{out.stdout.strip()} {out.stderr.strip()}", pytrace=False)


def job_processes(ray_tmp: str) -> dict[int, str]:
    """Live processes whose command line names a job's Ray temp dir (`ray start --temp-dir=DIR`,
    srun's steps, and Ray's processes under DIR/): pid -> name."""
    named = re.compile(re.escape(ray_tmp) + r"(/|\s|$)")
    found = {}
    for p in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and named.search(" ".join(p.info["cmdline"] or [])):
                found[p.info["pid"]] = p.info["name"]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def listening(procs: dict[int, str]) -> set[tuple[str, str]]:
    """(process name, address) for each TCP address these processes listen on."""
    out = set()
    for pid, name in procs.items():
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out |= {(name, c.laddr.ip) for c in conns if c.status == psutil.CONN_LISTEN}
    return out


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return addr.is_loopback or (addr.version == 6 and addr.ipv4_mapped is not None and addr.ipv4_mapped.is_loopback)
