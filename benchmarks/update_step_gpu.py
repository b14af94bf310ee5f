"""One DAPO update of a 0.5B-class Qwen2 shape on one GPU, against the planner's estimate.

    python benchmarks/update_step_gpu.py [--tokens 16384 --seq-len 1024] [--json OUT.json]

A random Qwen2 model of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV heads,
vocabulary 151,936, tied embeddings) is written as an HF checkpoint, loaded into the Megatron
actor (bf16 parameters, fp32 master weights, distributed optimizer, world size 1 with NCCL)
and trained for one update on a token budget of --tokens, with activation recompute off and
on. Printed per setting: step time, tokens/s, peak GPU memory, and the ratio to what
the planner predicts for the same shape (memory: model states + activations + logits + log-prob
buffers; time: its 6N (8N with recompute) FLOPs per token at its MFU). The baseline is the
planner, computed in the same run. Needs CUDA; uses the attention of the installed stack
(megatron-core's local spec without Transformer Engine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
         "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 4096,
         "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}


def make_checkpoint(out: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**SHAPE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out


def batch_of(tokens: int, seq_len: int, vocab: int):
    from megatron_dapo.actor.microbatch import RolloutBatch

    num = tokens // seq_len
    ids = torch.randint(0, vocab, (num, seq_len))
    mask = torch.zeros(num, seq_len, dtype=torch.bool)
    mask[:, seq_len // 4:] = True  # a quarter prompt, the rest response
    adv = torch.where(torch.rand(num, 1) < 0.5, -1.0, 1.0).expand(num, seq_len) * mask
    return RolloutBatch(input_ids=ids, seq_lens=torch.full((num,), seq_len), response_mask=mask,
                        advantages=adv.contiguous())


def plan_for(ckpt: Path, tokens: int, recompute: bool) -> tuple[float, float, object]:
    from megatron_dapo.config.loader import load_config
    from megatron_dapo.plan import GPUS, Assumptions, ModelDims, make_plan

    cfg = load_config(None, [f"model.hf_checkpoint={ckpt}", f"trainer.max_tokens_per_microbatch={tokens}",
                             f"model.recompute_activations={str(recompute).lower()}", "data.train_files=[x.jsonl]",
                             "parallel.use_distributed_optimizer=true", "trainer.device=cuda"])
    dims = ModelDims.from_hf(json.loads((ckpt / "config.json").read_text()), "qwen2-0.5b-shape", str(ckpt))
    plan = make_plan(cfg, dims, nodes=1, gpus_per_node=1, hardware=GPUS["h100"])
    act = plan.activation_recompute_bytes if recompute else plan.activation_bytes
    mem = plan.model_state_bytes + act + plan.logits_bytes + plan.logprob_chunk_bytes
    a = Assumptions()
    step_s = (8 if recompute else 6) * plan.num_params * tokens / (GPUS["h100"].peak_tflops * 1e12 * a.mfu)
    return mem, step_s, plan


def run(ckpt: Path, tokens: int, seq_len: int, recompute: bool, reps: int) -> dict:
    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.config import OptimConfig
    from megatron_dapo.models import adapter_for

    dims = parallel.initialize_model_parallel(1, 1, seed=0)
    adapter = adapter_for(ckpt)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    actor = MegatronActor(adapter=adapter, dims=dims, hf_checkpoint=ckpt,
                          optimizer_config=make_optimizer_config(OptimConfig(lr=1e-6), dtype=torch.bfloat16,
                                                                 use_distributed_optimizer=True),
                          recompute="full" if recompute else "none", max_tokens_per_microbatch=tokens)
    batch = batch_of(tokens, seq_len, SHAPE["vocab_size"])
    batch.old_log_probs, _ = actor.compute_log_probs(batch, 1.0)
    loss = LossSettings()
    times = []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = actor.train_step(batch, loss)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated()
    del actor
    torch.cuda.empty_cache()
    step = statistics.median(times)
    return {"recompute": recompute, "step_s": step, "tokens_per_s": tokens / step, "peak_bytes": peak,
            "grad_norm": metrics["actor/grad_norm"], "pg_loss": metrics["actor/pg_loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default=os.environ.get("OUT", ".") + "/update_step_gpu.json")
    args = parser.parse_args()
    from megatron_dapo import parallel

    parallel.init_distributed("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "qwen2-0.5b-shape")
        rows = []
        for recompute in (False, True):
            try:
                row = run(ckpt, args.tokens, args.seq_len, recompute, args.reps)
            except torch.cuda.OutOfMemoryError as err:
                print(f"recompute={recompute}: out of memory: {str(err).splitlines()[0]}")
                torch.cuda.empty_cache()
                continue
            row["plan_bytes"], row["plan_step_s"], plan = plan_for(ckpt, args.tokens, recompute)
            row["num_params"] = plan.num_params
            rows.append(row)
    print(f"\n{torch.cuda.get_device_name()}: Qwen2 0.5B shape ({SHAPE['num_hidden_layers']} layers), "
          f"{args.tokens} tokens per update ({args.tokens // args.seq_len} x {args.seq_len}), bf16")
    print(f"{'recompute':<10}{'step s':>8}{'tokens/s':>10}{'peak GiB':>10}{'plan GiB':>10}{'peak/plan':>10}"
          f"{'plan s':>8}{'step/plan':>10}")
    for r in rows:
        print(f"{'on' if r['recompute'] else 'off':<10}{r['step_s']:8.3f}{r['tokens_per_s']:10.0f}"
              f"{r['peak_bytes'] / 2**30:10.2f}{r['plan_bytes'] / 2**30:10.2f}{r['peak_bytes'] / r['plan_bytes']:10.2f}"
              f"{r['plan_step_s']:8.3f}{r['step_s'] / r['plan_step_s']:10.2f}")
    Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
