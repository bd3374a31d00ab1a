"""Adapters that run environments written for other standards, unchanged, in tidal's rollout:
reasoning-gym datasets (`task.dataset: reasoning_gym:TASK`), verifiers environments
(`task.env: verifiers:MODULE`), TextArena games (`task.env: textarena:GAME`) and OpenEnv
servers (`task.env: openenv:URL_OR_APP`).

Each standard is an optional extra, imported only by its own module here (and lazily), so tidal
installs and imports without them. What each config prefix needs is tidal/importing.py's
`EXTRAS`, checked when the config loads (TaskConfig), so a missing package is named with its
pip command before anything starts, never as an ImportError in a worker.
"""

