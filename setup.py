"""megatron-moe: dropless Mixture-of-Experts for Megatron (MegaBlocks' idea, rebuilt in Triton).

    pip install .                      # the layer: torch + triton
    pip install ".[train]"             # + the Megatron integration and the training program
    pip install ".[train,wandb,plots]" # + Weights & Biases logging and run-comparison plots
    pip install -c constraints.txt -e ".[train,wandb,plots,test]"   # development (CI's versions)
"""
from setuptools import setup

# megatron-core: the releases the CPU suite passed with (0.16.0, 0.16.1); 0.15.x moves the rotary
# embedding's table to CUDA on the CPU, 0.17+ has no Python 3.11 wheels.
MEGATRON = ["megatron-core>=0.16.0,<0.17", "pyyaml"]
TRAIN = MEGATRON + ["numpy", "sentencepiece", "tqdm"]

setup(
    name="megatron-moe",
    version="0.2.0",
    description="Dropless Mixture-of-Experts for megatron-core GPT models: block-sparse and grouped "
                "Triton kernels, expert parallelism, a Megatron layer spec and a pretraining program",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    python_requires=">=3.10",
    packages=[
        "megatron_moe", "megatron_moe.ops", "megatron_moe.kernels",
        "megatron_moe.megatron",
        "megatron_moe.training", "megatron_moe.training.data",
        "megatron_moe.tools", "megatron_moe.configs",
    ],
    # kernels/, tools/ and configs/ sit at the top of the repository and install inside the package
    package_dir={"megatron_moe.kernels": "kernels", "megatron_moe.tools": "tools",
                 "megatron_moe.configs": "configs"},
    package_data={"megatron_moe.configs": ["*.yaml"], "megatron_moe.kernels": ["tuned/*.json"]},
    install_requires=["torch>=2.6", "triton>=3.3"],
    extras_require={
        "megatron": MEGATRON,
        "train": TRAIN,
        "wandb": ["wandb"],
        "plots": ["matplotlib"],
        "test": ["pytest", "pytest-timeout", "matplotlib"],
    },
    entry_points={
        "console_scripts": [
            "megatron-moe-train=megatron_moe.training.train:main",
            "megatron-moe-prepare-data=megatron_moe.training.data.prepare_cli:main",
            "megatron-moe-compare-runs=megatron_moe.tools.compare_runs:main",
            "megatron-moe-find-micro-batch=megatron_moe.tools.find_micro_batch:main",
            "megatron-moe-megatron-lm-args=megatron_moe.tools.megatron_lm_args:main",
            "megatron-moe-rank-timelines=megatron_moe.tools.rank_timelines:main",
        ]
    },
)
