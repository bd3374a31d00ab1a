"""Metrics sinks, the episode store and the console progress line."""
