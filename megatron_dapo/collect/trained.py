"""A record of every trained sample: what ties each reward and advantage to its own response.

With `MEGATRON_DAPO_TRAINED_SAMPLES=<path>` the controller appends one JSON line per row of the
batch it dispatches to the actor (step 4's split over mini-batches and DP ranks): the step, the
row's group (its index in the step's batch) and sample, the group's prompt ids and ground truth,
the row's own prompt ids, response ids and advantage (what the loss weighs its tokens with),
whether it carries loss, and the sample's score and shaped reward. A test recomputes each reward
from the response ids and each advantage from its group's rewards (tests/trained_samples.py), so
a permutation of rewards, a group mixed with another or a flipped sign shows, whichever of the
collection modes, engines or loops built the batch. Unset, it costs one environment lookup per
step. `logging.rollout_dump_freq` is the user's view of sampled rollouts; this is the tests'.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_dapo.collect.types import Group

TRAINED_SAMPLES_ENV = "MEGATRON_DAPO_TRAINED_SAMPLES"


def trained_sample_records(step: int, groups: Sequence[Group], per_dp: Sequence[Sequence[Sequence[tuple]]]
                           ) -> list[dict[str, Any]]:
    """One record per dispatched row, in dispatch order (DP rank, mini-batch, row).

    Args:
        groups: the step's batch.
        per_dp: the rows collect/shards.py's `split_batch` made of it, [dp_rank][mini_batch] -> rows of
            (prompt_ids, response_ids, advantage, rollout_lps, keep, routes, loss_mask), which hold
            the samples' own lists: a row is traced back to its sample through its response list.
    """
    where = {id(s.response_ids): (g, j) for g, group in enumerate(groups) for j, s in enumerate(group.samples)}
    records = []
    for rank, mini_batches in enumerate(per_dp):
        for mini_batch, rows in enumerate(mini_batches):
            for prompt_ids, response_ids, advantage, _, keep, _, _ in rows:
                g, j = where[id(response_ids)]
                sample, record = groups[g].samples[j], groups[g].prompt
                records.append({"step": step, "dp_rank": rank, "mini_batch": mini_batch, "group": g, "sample": j,
                                "group_prompt_ids": list(record.prompt_ids), "ground_truth": record.ground_truth,
                                "prompt_ids": list(prompt_ids), "response_ids": list(response_ids),
                                "advantage": float(advantage), "trained": bool(keep), "score": sample.score,
                                "reward": sample.reward, "finish_reason": sample.finish_reason})
    return records


def record_trained_samples(step: int, groups: Sequence[Group], per_dp: Sequence[Sequence[Sequence[tuple]]]) -> None:
    """Append the step's records to $MEGATRON_DAPO_TRAINED_SAMPLES, if it is set (controller)."""
    path = os.environ.get(TRAINED_SAMPLES_ENV)
    if not path:
        return
    with Path(path).open("a", encoding="utf-8") as f:
        for r in trained_sample_records(step, groups, per_dp):
            f.write(json.dumps(r) + "\n")
