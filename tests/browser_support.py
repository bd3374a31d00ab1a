"""Where the browser tests may skip: only where Debian's headless Chromium is missing and
could not be installed here (not root, or no apt-get). Where scripts/setup.sh could have
installed it, or with TIDAL_REQUIRE_BROWSER=1 (CI), a missing browser fails the test."""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = "/usr/lib/chromium/chromium-headless-shell"


def require_chromium() -> str:
    """The headless shell's path, or a skip/fail naming what is missing."""
    pytest.importorskip("playwright.async_api", reason="playwright is in the dev extra (and the browser extra)")
    if os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    if os.environ.get("TIDAL_REQUIRE_BROWSER") == "1" or (os.geteuid() == 0 and shutil.which("apt-get")):
        pytest.fail(f"{CHROMIUM} is missing although this machine could install it (scripts/setup.sh does, as "
                    "root with apt-get: chromium-headless-shell); the browser tests do not skip here", pytrace=False)
    pytest.skip("Debian's chromium-headless-shell is not installed and cannot be here (not root, or no apt-get)")
