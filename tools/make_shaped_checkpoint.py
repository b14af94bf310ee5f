"""Write a random HF checkpoint at a named model's real shapes with N layers (bf16, hub-style shards).

    python tools/make_shaped_checkpoint.py --model Qwen2.5-32B --layers 2 --out /data/q32-2l
    python tools/make_shaped_checkpoint.py --model Qwen3-30B-A3B --layers 2 --out /data/a3b-2l
    python tools/make_shaped_checkpoint.py --model examples/model_configs/Qwen2.5-7B.json --layers 4 \\
        --out DIR --set hidden_size=256 --set vocab_size=1000      # a shrunk variant (tests)

--model is a name under examples/model_configs/ (the published config.json values, typed
in: nothing is downloaded) or a path to a config.json. The flagship's shape bugs (one KV
head per rank at TP=8, the padded 152,064-row vocabulary, a 1.5 GB embedding, 4 GB
shards) show at 2 layers; benchmarks/scale.py rehearses conversion on it. Exit 2 with one
line on bad input.
"""

import sys

if __name__ == "__main__":
    import argparse
    import json
    from pathlib import Path

    from megatron_dapo.convert import parse_size
    from megatron_dapo.errors import EXIT_USER_ERROR, UserError
    from megatron_dapo.models.shaped import shaped_config, write_shaped_checkpoint

    configs = Path(__file__).resolve().parents[1] / "examples" / "model_configs"
    parser = argparse.ArgumentParser(prog="make_shaped_checkpoint", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a name under examples/model_configs/ or a config.json path")
    parser.add_argument("--layers", type=int, required=True, help="num_hidden_layers of the checkpoint")
    parser.add_argument("--out", required=True, help="new directory")
    parser.add_argument("--max-shard-size", default="4GB", help="largest safetensors shard (the hub's: 4GB)")
    parser.add_argument("--seed", type=int, default=0, help="weights' generator seed")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="replace a config field (VALUE is JSON), e.g. hidden_size=256")
    args = parser.parse_args()
    try:
        path = Path(args.model) if args.model.endswith(".json") else configs / f"{args.model}.json"
        if not path.is_file():
            known = sorted(p.stem for p in configs.glob("*.json"))
            raise UserError(f"--model {args.model!r}: {path} does not exist; name one of {known} or a config.json")
        overrides = {}
        for item in args.set:
            key, sep, value = item.partition("=")
            if not sep:
                raise UserError(f"--set {item!r} is not KEY=VALUE; write e.g. --set hidden_size=256")
            try:
                overrides[key] = json.loads(value)
            except json.JSONDecodeError:
                overrides[key] = value
        config = shaped_config(json.loads(path.read_text()), args.layers, overrides)
        files = write_shaped_checkpoint(args.out, config, max_shard_bytes=parse_size(args.max_shard_size),
                                        seed=args.seed)
    except UserError as e:
        print(f"make_shaped_checkpoint: error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    size = sum(f.stat().st_size for f in files)
    print(f"wrote {args.out}: {len(files)} shards, {size / 2**30:.2f} GiB")
