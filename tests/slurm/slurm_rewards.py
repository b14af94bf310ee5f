"""A reward for the SLURM trainer tests, importable by name (PYTHONPATH=tests/slurm).

The tests run a randomly initialised tiny model for a few steps: the math verifier would
score every response -1, every group would be dropped by dynamic sampling, and no batch
would fill. Scoring the parity of the response's UTF-8 byte sum gives every group a
spread of scores without a trained policy.
"""


def byte_parity(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """+1 when the response's UTF-8 bytes sum to an even number, else -1."""
    acc = sum(solution_str.encode()) % 2 == 0
    return {"score": 1.0 if acc else -1.0, "acc": acc}
