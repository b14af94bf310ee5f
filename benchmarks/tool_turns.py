"""What a tool turn costs on each engine: one episode batch against the same tokens in one turn.

    python benchmarks/tool_turns.py [--engines local,sglang,vllm] [--repeats 5]

A tiny random Qwen2 (hidden 128) is served by each engine in turn. Per engine, in one sitting:
- baseline: one generate call, 8 prompts x n 4, 24 new tokens each, no stop token (one turn);
- episodes: the same prompts through tools/episode.EpisodeRunner whose call-end marker is a
  token the model samples often, answered by a 3-token tool with no work (so the time is the
  engine's), 24 tokens of budget per episode: 2-3 turns per episode;
- per turn: (episodes - baseline) / extra turns, the price of one more round trip.
The ratio column is episodes / baseline (the physical limit is the tokens: episodes write about
as many). Medians over --repeats, after one warm-up call per engine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def _engine(name: str, checkpoint: Path, log_dir: Path):
    if name == "local":
        from megatron_dapo.rollout.local.engine import LocalEngine

        return LocalEngine(checkpoint, name="local0")
    if name == "sglang":
        from megatron_dapo.rollout.sglang.engine import SGLangEngine
        from megatron_dapo.rollout.sglang.server import SGLangServerConfig

        config = SGLangServerConfig(model_path=str(checkpoint), device="cpu", dtype="float32",
                                    max_total_tokens=32768, host="127.0.0.1", log_path=str(log_dir / "sglang0.log"))
        return SGLangEngine.launch(config, name="sglang0", vocab_size=100, startup_timeout_s=600)
    from megatron_dapo.rollout.vllm.engine import VLLMEngine

    return VLLMEngine.launch(checkpoint, name="vllm0", log_path=log_dir / "vllm0.log", host="127.0.0.1",
                             device="cpu", vocab_size=100, startup_timeout_s=900)


def measure(name: str, checkpoint: Path, log_dir: Path, repeats: int) -> dict[str, float]:
    from episode_utils import ANSWER_IDS, IdTokenizer

    from megatron_dapo.rollout.engine import SamplingParams
    from megatron_dapo.tools.episode import EpisodeRunner, EpisodeSettings
    from megatron_dapo.tools.formats import CallFormat
    from megatron_dapo.tools.sandbox import ToolResult

    prompts = [[5 + i, 17, 42, 8 + i] for i in range(8)]
    engine = _engine(name, checkpoint, log_dir)
    try:
        plain = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=1)
        warm = engine.generate(prompts, plain)
        close = Counter(t for r in warm for t in r.output_ids if t > 4 and t not in ANSWER_IDS).most_common(1)[0][0]
        tok = IdTokenizer({"<c>": 2, "</c>": close, "<r>": 3, "</r>": 4}, 100)
        runner = EpisodeRunner(EpisodeSettings(
            fmt=CallFormat("ids", "", "</c>", "<r> ", " </r>", default_tool="answer"),
            tools={"answer": lambda _a: ToolResult(" ".join(map(str, ANSWER_IDS)), "ok", 0.0)},
            max_turns=4, max_tool_output_tokens=8, max_response_tokens=24), tok)
        base, epi, turns, tokens = [], [], [], []
        for k in range(repeats):
            params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=10 + k)
            start = time.perf_counter()
            engine.generate(prompts, params)
            base.append(time.perf_counter() - start)
            start = time.perf_counter()
            results = runner.generate(engine.generate, prompts, params)
            epi.append(time.perf_counter() - start)
            turns.append(max(r.episode.turns for r in results))
            tokens.append(sum(len(r.output_ids) for r in results) / len(results))
        runner.close()
    finally:
        engine.shutdown() if hasattr(engine, "shutdown") else None
    b, e = statistics.median(base), statistics.median(epi)
    extra = statistics.median(turns) - 1
    return {"baseline_s": b, "episodes_s": e, "ratio": e / b, "turns_max": statistics.median(turns),
            "per_turn_s": (e - b) / extra if extra > 0 else float("nan"), "tokens": statistics.median(tokens)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="local,sglang,vllm")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from model_utils import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny_checkpoint(Path(tmp) / "m", "qwen2", seed=3, shape={"hidden_size": 128})
        rows = {}
        for name in args.engines.split(","):
            try:
                rows[name] = measure(name, checkpoint, Path(tmp), args.repeats)
            except Exception as err:  # an engine that is not installed is reported, not fatal
                rows[name] = f"{type(err).__name__}: {str(err)[:120]}"
    print(f"{'engine':8} {'1 turn s':>9} {'episodes s':>11} {'ratio':>6} {'turns':>6} {'s/turn':>7} {'tokens':>7}")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"{name:8} not measured: {row}")
            continue
        print(f"{name:8} {row['baseline_s']:9.3f} {row['episodes_s']:11.3f} {row['ratio']:6.2f} "
              f"{row['turns_max']:6.0f} {row['per_turn_s']:7.3f} {row['tokens']:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
