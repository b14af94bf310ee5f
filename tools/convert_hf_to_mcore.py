"""Convert an HF checkpoint into a Megatron torch_dist model checkpoint the trainer can start from.

    python tools/convert_hf_to_mcore.py --hf DIR --out DIR
    torchrun --nproc-per-node 2 tools/convert_hf_to_mcore.py --hf DIR --out DIR --tp 2

The result loads at any TP/PP layout and embeds the HF config + tokenizer files, so
tools/convert_mcore_to_hf.py needs nothing else. Exit 2 with one line on bad input.
The work stays under ``__main__``: dist_checkpointing's writer starts a "spawn" Manager
that re-imports this module.
"""

import sys

if __name__ == "__main__":
    # One process streams on the CPU: hide the GPUs before megatron-core touches CUDA (a torchrun
    # launch keeps them). megatron_dapo/device.py says why (hide_gpus_for_cpu_work).
    from megatron_dapo.device import hide_gpus_for_cpu_work

    hide_gpus_for_cpu_work()
    from megatron_dapo.convert import tool_main

    sys.exit(tool_main("hf-to-mcore"))
