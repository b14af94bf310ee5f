"""Check that our Megatron model of an HF checkpoint computes what transformers computes.

    torchrun --nproc-per-node 2 tools/check_parity.py --hf-checkpoint DIR --tp 2 --pp 1 [--sequence-parallel]
    torchrun --nproc-per-node 4 tools/check_parity.py --hf-checkpoint QWEN3_MOE_DIR --tp 2 --ep 2

Every rank builds its shard of the Megatron model in the given layout and loads the
checkpoint into it; the same random tokens go through it; global rank 0 then loads the
model with transformers, runs the tokens, and prints the largest absolute difference of
the log-probs of the actual next tokens and the mean KL(transformers || megatron).
Exit codes (of each rank; torchrun reports any failure as 1): 0 within tolerance, 1 above
it, 2 for bad input (one line on stderr, no traceback). Runs on CPU (gloo) or GPU (nccl).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

DEFAULT_TOLERANCE = {"fp32": 1e-4, "bf16": 0.1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--hf-checkpoint", required=True, help="HF checkpoint directory (config.json + safetensors)"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel size (mixture-of-experts models; divides the number of experts)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="build the model with Megatron sequence parallelism (needs --tp > 1)")
    parser.add_argument(
        "--dtype", choices=sorted(DEFAULT_TOLERANCE), default="fp32", help="compute dtype of both models"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help=f"largest allowed |delta log p| of the next tokens (default {DEFAULT_TOLERANCE})",
    )
    parser.add_argument("--num-tokens", type=int, default=64, help="sequence length of each random sample")
    parser.add_argument("--batch-size", type=int, default=2, help="number of random samples")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where to run")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    """Run the comparison; returns the exit code (0 pass, 1 above tolerance)."""
    import torch
    import torch.distributed as dist

    from megatron_dapo import launcher, parallel
    from megatron_dapo.models import adapter_for
    from megatron_dapo.models.parity import compare_log_probs, full_vocab_log_probs

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    tolerance = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE[args.dtype]
    if args.num_tokens < 2 or args.batch_size < 1:
        raise ValueError(
            f"--num-tokens {args.num_tokens} / --batch-size {args.batch_size}: need at least 2 tokens and 1 sample"
        )
    if tolerance < 0:
        raise ValueError(f"--tolerance {tolerance} is negative; pass a bound >= 0 on |delta log p|")
    if args.sequence_parallel and (args.tp < 2 or args.num_tokens % args.tp != 0):
        raise ValueError(f"--sequence-parallel needs --tp > 1 and --num-tokens a multiple of it "
                         f"(got --tp {args.tp}, --num-tokens {args.num_tokens}): sequence parallelism "
                         "splits the tokens over the TP ranks")
    adapter = adapter_for(args.hf_checkpoint)
    # Checked before any process group exists, so bad input fails fast and alike on every rank.
    parallel.validate_layout(
        world_size=launcher.launcher_ranks()[1],
        tp=args.tp,
        pp=args.pp,
        cp=1,
        device=torch.device("cpu"),
        num_attention_heads=adapter.hf.num_attention_heads,
        num_query_groups=adapter.hf.num_kv_heads,
        num_layers=adapter.hf.num_layers,
        ep=args.ep,
        num_experts=adapter.hf.num_experts or None,
    )
    if args.ep > 1 and not adapter.hf.is_moe:
        raise ValueError(f"--ep {args.ep}: {adapter.hf.architecture} has no experts; use --ep 1")
    env = parallel.init_distributed(args.device)
    dims = parallel.initialize_model_parallel(
        args.tp,
        args.pp,
        num_attention_heads=adapter.hf.num_attention_heads,
        num_query_groups=adapter.hf.num_kv_heads,
        num_layers=adapter.hf.num_layers,
        ep=args.ep,
        num_experts=adapter.hf.num_experts or None,
    )
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, adapter.hf.vocab_size, (args.batch_size, args.num_tokens), generator=generator)
    tokens = tokens.to(env.device)

    model = adapter.build_model(dims, dtype=dtype, init_weights=False, sequence_parallel=args.sequence_parallel)
    adapter.load_hf(model, args.hf_checkpoint, dims)
    model.eval()
    ours = full_vocab_log_probs(model, dims, tokens, adapter.hf.vocab_size)
    del model
    # Rank 0 may not hold the last stage: the first (last stage, tp 0, dp 0) rank sends to it.
    holders = [None] * dims.world_size
    dist.all_gather_object(holders, dims.is_last_stage and dims.tp_rank == 0 and dims.dp_rank == 0)
    source = holders.index(True)
    if ours is None:
        ours = torch.empty(args.batch_size, args.num_tokens, adapter.hf.vocab_size, device=env.device)
    dist.broadcast(ours, src=source)
    if not dims.is_controller:
        return 0

    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(
        args.hf_checkpoint, dtype=dtype, attn_implementation="eager"
    )
    with torch.no_grad():
        reference = torch.log_softmax(hf_model.to(env.device)(input_ids=tokens).logits.float(), dim=-1)
    max_diff, mean_kl = compare_log_probs(reference, ours, tokens)
    verdict = "PASS" if max_diff <= tolerance else "FAIL"
    print(
        f"{verdict} tp={args.tp} pp={args.pp} ep={args.ep} sp={int(args.sequence_parallel)} dtype={args.dtype} tokens={args.batch_size}x{args.num_tokens}: "
        f"max |delta log p(next token)| = {max_diff:.3e} (tolerance {tolerance:.1e}), mean KL = {mean_kl:.3e}",
        flush=True,
    )
    return 0 if verdict == "PASS" else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point: bad input -> one line on stderr and exit code 2."""
    args = parse_args(argv)
    # megatron-core announces its CPU fallbacks on import; on CPU that is expected, and it
    # would bury the one-line error below.
    warnings.filterwarnings(
        "ignore", message=r".*(Transformer Engine|Apex).*not installed", category=UserWarning
    )
    from megatron_dapo import parallel

    try:
        return run(args)
    except (ValueError, FileNotFoundError) as err:
        # Every rank sees the same bad input; one line is enough.
        if os.environ.get("RANK", "0") == "0":
            print(f"check_parity: error: {err}", file=sys.stderr)
        return 2
    finally:
        parallel.destroy()


if __name__ == "__main__":
    sys.exit(main())
