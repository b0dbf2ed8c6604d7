# megatron-moe on a CUDA PyTorch image (no Transformer Engine, no Apex: not needed).
#
#   docker build -t megatron-moe .
#   docker run --gpus all --ipc=host --rm -v $PWD/runs:/workspace/megatron-moe/runs megatron-moe \
#       scripts/pretrain.sh dmoe-xs
#   docker run --rm megatron-moe megatron-moe-train            # tiny-cpu, no GPU needed
#
# The devel image brings the C compiler Triton needs to build its kernel launchers at run time.
# Other bases work too (e.g. --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:25.04-py3; its TE and
# Apex are simply not used).
ARG BASE_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    NCCL_NVLS_ENABLE=0

WORKDIR /workspace/megatron-moe
COPY . .
# The package with the training program, W&B and plots, at constraints.txt's versions; torch and
# triton stay the base image's (setup.py asks for torch>=2.6, triton>=3.3).
RUN grep -vE '^(torch|triton)==' constraints.txt > /tmp/constraints.txt \
 && python -m pip install -c /tmp/constraints.txt ".[train,wandb,plots]" \
 && python -c "import megatron_moe.training.train, megatron.core; print('megatron-moe ok')"


CMD ["megatron-moe-train", "--help"]
