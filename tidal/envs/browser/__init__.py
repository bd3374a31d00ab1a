"""The browser environment: web tasks in headless Chromium (docs/browser.md).

`BrowserEnv` (tidal.envs.browser.env) is the environment, `BrowserPool` and `BrowserConfig`
(tidal.envs.browser.pool) the isolated browsers it runs in, and tidal.envs.browser.tasks the
seeded task families.
"""

from tidal.envs.browser.env import BrowserEnv
from tidal.envs.browser.pool import BrowserConfig, BrowserPool

__all__ = ["BrowserConfig", "BrowserEnv", "BrowserPool"]
