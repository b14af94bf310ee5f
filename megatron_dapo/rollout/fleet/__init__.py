"""Rollout engines on devices of their own (issue 41): the fleet's weight broadcast (broadcast.py)."""
