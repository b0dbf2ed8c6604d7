# Sourced by the device scripts (device_run.sh, multi_gpu.sh, train_ab.sh) from the repository
# root: the environment a lent GPU machine needs, and helpers they share.
# The machine has torch/triton/sentencepiece but no registry: megatron-core travels as a wheel in
# .whl/, and the project is not pip-installed, so kernels/ and tools/ are mapped into megatron_moe by hand.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
for d in kernels tools; do [[ -e megatron_moe/$d ]] || ln -sfn ../$d megatron_moe/$d; done
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

write_env() {  # FILE: the GPUs, torch / Triton / CUDA versions and the UTC date
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
    date -u +%Y-%m-%dT%H:%M:%SZ; } > "$1" 2>&1
}

split_overrides() {  # "a=1,mb=32,b=2" DEFAULT_MB: sets mb (mb=N, else DEFAULT_MB) and extra (the rest)
  local o
  mb=$2; extra=()
  for o in ${1//,/ }; do
    if [[ $o == mb=* ]]; then mb=${o#mb=}; else extra+=("$o"); fi
  done
}
