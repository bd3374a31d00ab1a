"""Composition of the roles: controller, rollout, tasks, evaluation."""
