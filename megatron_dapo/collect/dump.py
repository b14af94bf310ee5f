"""logging.rollout_dump_freq: the training batch's sampled rollouts, every N steps, as JSONL.

`<output_dir>/rollouts.jsonl` gets one line per response of the step's training batch (the
groups dynamic sampling kept): the step, the prompt and the response as text, the answer,
the data source, the verifier's score and accuracy, the shaped reward, the advantage, the
length and how the response ended, and the reward function's extra numbers. Like
metrics.jsonl, a resumed run first drops the lines of steps after its checkpoint
(truncate_dump), so no step appears twice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from megatron_dapo.collect.types import Group
from megatron_dapo.data.tokenizer import Tokenizer

ROLLOUTS_FILENAME = "rollouts.jsonl"


def should_dump(step: int, freq: int) -> bool:
    """Whether step `step` is dumped at logging.rollout_dump_freq=`freq` (0 = never)."""
    return freq > 0 and step % freq == 0


def dump_rollouts(path: Path, step: int, groups: Sequence[Group], tokenizer: Tokenizer) -> int:
    """Append one line per response of `groups` to `path` (flushed and fsync'd); returns the lines written."""
    lines = []
    for g in groups:
        for s in g.samples:
            lines.append(json.dumps({
                "step": step, "data_source": g.prompt.data_source, "prompt_index": g.prompt.index,
                "prompt": g.prompt.prompt_text, "response": tokenizer.decode(s.response_ids),
                "ground_truth": g.prompt.ground_truth, "score": s.score, "acc": s.acc, "reward": s.reward,
                "advantage": s.advantage, "response_length": len(s.response_ids), "finish_reason": s.finish_reason,
                **({"reward_extra": s.reward_extra} if s.reward_extra else {}),
            }) + "\n")
    with path.open("a", encoding="utf-8") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    return len(lines)


def truncate_dump(path: Path, step: int) -> None:
    """Drop the lines of steps after `step` (and a torn last line), atomically; no file, nothing to do."""
    if not path.is_file():
        return
    kept, changed = [], False
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            changed = True
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step and line.endswith("\n"):
            kept.append(line)
        else:
            changed = True
    if changed:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
