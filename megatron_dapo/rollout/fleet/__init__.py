"""Rollout engines on devices of their own (issue 41): the weight broadcast (broadcast.py, group.py) and each CPU server's cores (cores.py)."""
