"""Rollout engines behind one protocol: token ids in; token ids, log-probs, finish reason out."""

from tidal.engines.base import Engine

__all__ = ["Engine"]
