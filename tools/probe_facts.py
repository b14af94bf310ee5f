"""What a policy knows of the embedded task's column facts: teacher-forced probabilities.

    python tools/probe_facts.py CHECKPOINT --task TASK_DIR [--splits val,train] [--json OUT]

CHECKPOINT is an HF directory or a training checkpoint (runs/<name>/checkpoints/step_N, exported
on the fly); TASK_DIR is the embedded task's cache entry ($MEGATRON_DAPO_CACHE/arithmetic-*/).

For every +/- problem of the splits, the worked solution ("7+8=15\\n4+3+1=8\\nAnswer: 85") is fed
after the prompt and the probability of each written result is read off: the digits after a
line's "=" given everything before them, and the answer's digits. Reported:
- per column fact ("4+3+1=8"), the mean probability over the problems that use it, and how many
  facts sit below 0.05 ("stuck": a sampler at temperature 1 writes them right about once in 20
  tries or less, and RL only reinforces what its samples write) by kind: plain sums and
  differences, carries ("x+y+1"), borrows ("x-y-1") and borrowed units ("1x-y");
- per problem kind (one column; two columns without a carry or borrow; with one), the mean
  probability of the whole solution and the share of problems below 0.02.

This is how docs/benchmarks.md (issue 27) found why some seeds of the default run plateau.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STUCK = 0.05


def fact_kind(line: str) -> str:
    """add / add+carry / sub / sub+borrow / sub-teen (a borrowed units column, "14-7=7")."""
    lhs = line.split("=")[0]
    if "+" in lhs:
        return "add+carry" if lhs.count("+") == 2 else "add"
    if lhs.count("-") == 2:
        return "sub+borrow"
    return "sub-teen" if int(lhs.split("-")[0]) >= 10 else "sub"


def problem_kind(lines: list[str], op: str) -> str:
    kind = "add" if op == "+" else "sub"
    if len(lines) == 1:
        return f"{kind} 1 column"
    carried = any(fact_kind(line) in ("add+carry", "sub+borrow") for line in lines)
    return f"{kind} {'with' if carried else 'no'} carry"


def result_tokens(tokenizer, lines: list[str], answer: str) -> tuple[list[int], list[tuple[str, list[int]]]]:
    """The worked solution's token ids, and for every written result (each line's digits after
    "=", then the answer's) its name and the positions of its tokens in those ids."""
    response = "\n".join(lines) + f"\nAnswer: {answer}"
    spans, offset = [], 0
    for line in lines:
        start = response.index(line, offset)
        spans.append((line, start + line.index("=") + 1, start + len(line)))
        offset = start + len(line)
    spans.append(("answer", response.index("Answer: ") + len("Answer: "), len(response)))
    ids = tokenizer.encode(response)
    ends = [len(tokenizer.decode(ids[: k + 1])) for k in range(len(ids))]
    starts = [0, *ends[:-1]]
    return ids, [(name, [k for k in range(len(ids)) if lo <= starts[k] < hi]) for name, lo, hi in spans]


def probe(model, tokenizer, rows: list[dict]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(fact -> its probabilities, problem kind -> whole-solution probabilities)."""
    import torch

    from megatron_dapo.data.arithmetic import column_lines

    facts: dict[str, list[float]] = collections.defaultdict(list)
    problems: dict[str, list[float]] = collections.defaultdict(list)
    for row in rows:
        info = row.get("extra_info") or {}
        if info.get("kind") not in ("add", "sub"):
            continue
        op = "+" if info["kind"] == "add" else "-"
        a, b = info["expression"].split(op)
        lines = column_lines(int(a), op, int(b))
        prompt = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": row["prompt"]}]))
        ids, spans = result_tokens(tokenizer, lines, row["answer"])
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        total = 0.0
        for name, positions in spans:
            lp = sum(float(logp[len(prompt) + k - 1, ids[k]]) for k in positions)
            total += lp
            if name != "answer":
                facts[name].append(math.exp(lp))
        problems[problem_kind(lines, op)].append(math.exp(total))
    return facts, problems


def report(facts: dict[str, list[float]], problems: dict[str, list[float]]) -> dict:
    mean = {f: sum(v) / len(v) for f, v in facts.items()}
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for f, p in mean.items():
        by_kind[fact_kind(f)].append(p)
    return {
        "facts": len(mean),
        "stuck_facts": sum(p < STUCK for p in mean.values()),
        "fact_kinds": {k: {"facts": len(v), "mean_p": sum(v) / len(v), "stuck": sum(p < STUCK for p in v)}
                       for k, v in sorted(by_kind.items())},
        "problem_kinds": {k: {"problems": len(v), "mean_p": sum(v) / len(v), "below_0.02": sum(p < 0.02 for p in v) / len(v)}
                          for k, v in sorted(problems.items())},
        "stuck": sorted(f for f, p in mean.items() if p < STUCK),
    }


def print_report(r: dict) -> None:
    print(f"{r['facts']} column facts, {r['stuck_facts']} stuck (p < {STUCK})")
    print("| fact kind | facts | mean p | stuck |\n|---|---|---|---|")
    for k, v in r["fact_kinds"].items():
        print(f"| {k} | {v['facts']} | {v['mean_p']:.2f} | {v['stuck']} |")
    print("\n| problem kind | problems | mean p(solution) | share p < 0.02 |\n|---|---|---|---|")
    for k, v in r["problem_kinds"].items():
        print(f"| {k} | {v['problems']} | {v['mean_p']:.3f} | {v['below_0.02']:.2f} |")
    print("\nstuck:", " ".join(r["stuck"]) or "none")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="HF directory or training checkpoint")
    parser.add_argument("--task", type=Path, required=True, help="the embedded task's directory (arithmetic-*)")
    parser.add_argument("--splits", default="val,train", help="task files to probe, comma-separated")
    parser.add_argument("--json", type=Path, default=None, help="also write the report as JSON")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from megatron_dapo.data.tokenizer import SPM_MODEL_FILENAME, load_tokenizer
    from megatron_dapo.evaluate import export_to_hf, is_hf_dir, resolve_training_checkpoint

    splits = [args.task / f"{s}.jsonl" for s in args.splits.split(",")]
    missing = [str(p) for p in splits if not p.is_file()]
    models = sorted(args.task.glob(f"tokenizer/*/{SPM_MODEL_FILENAME}"))
    if missing or not models:
        print(f"probe_facts: error: {args.task} is not an embedded task directory (missing {missing or 'its tokenizer'}); "
              "pass $MEGATRON_DAPO_CACHE/arithmetic-<key>", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        hf = args.checkpoint
        if not is_hf_dir(hf):
            training = resolve_training_checkpoint(hf)
            if training is None:
                print(f"probe_facts: error: {hf} is neither an HF directory nor a training checkpoint", file=sys.stderr)
                return 2
            hf = export_to_hf(training, Path(tmp) / "hf")
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        tokenizer = load_tokenizer(models[0])
        rows = [json.loads(line) for p in splits for line in p.read_text().splitlines() if line.strip()]
        r = report(*probe(model, tokenizer, rows))
    print_report(r)
    if args.json:
        args.json.write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
