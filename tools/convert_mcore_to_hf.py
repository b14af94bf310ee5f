"""Export a Megatron torch_dist checkpoint (training step_<N> or converted) as an HF model directory.

    python tools/convert_mcore_to_hf.py --ckpt RUN/checkpoints --out DIR [--max-shard-size 5GB]
    python tools/convert_mcore_to_hf.py --ckpt RUN/checkpoints/step_40 --out DIR --hf-config-from HF_DIR

Writes safetensors shards one by one, model.safetensors.index.json, config.json and the
tokenizer files, so transformers' AutoModelForCausalLM.from_pretrained(DIR) loads it.
Exit 2 with one line on a missing, truncated or mismatched checkpoint.
"""

import sys

if __name__ == "__main__":
    # One process streams on the CPU: hide the GPUs before megatron-core touches CUDA (a torchrun
    # launch keeps them). megatron_dapo/device.py says why (hide_gpus_for_cpu_work).
    from megatron_dapo.device import hide_gpus_for_cpu_work

    hide_gpus_for_cpu_work()
    from megatron_dapo.convert import tool_main

    sys.exit(tool_main("mcore-to-hf"))
