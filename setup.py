"""megatron-moe: dropless Mixture-of-Experts for megatron-core (MegaBlocks, rebuilt in Triton)."""
from setuptools import setup

setup(
    name="megatron-moe",
    version="0.1.0",
    description="Dropless MoE (block-sparse and grouped Triton kernels) for megatron-core GPT models",
    python_requires=">=3.10",
    packages=["megatron_moe", "megatron_moe.ops", "megatron_moe.kernels"],
    package_dir={"megatron_moe": "megatron_moe", "megatron_moe.kernels": "kernels"},
    install_requires=[
        "torch>=2.6",
        "triton>=3.3",
        "megatron-core==0.16.1",
        "numpy",
        "pyyaml",
        "sentencepiece",
        "tqdm",
        "wandb",
    ],
    extras_require={"test": ["pytest", "matplotlib"]},
    entry_points={
        "console_scripts": [
            "megatron-moe-train=megatron_moe.train:main",
            "megatron-moe-prepare-data=megatron_moe.data_prep:main",
        ]
    },
)
