"""The base of every config section: a pydantic model that refuses unknown keys.

The choice: `extra="forbid"`, so a misspelt key is an error naming it (tidal/config/load.py
suggests the key meant) rather than a setting silently ignored; `validate_assignment`, so a
value set after loading is checked as one read from YAML is.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
