# Sourced by the GPU scripts (device_run.sh, multi_gpu.sh, train_ab.sh) from the repository
# root: run from a source checkout without `pip install` (kernels/ and tools/ mapped into
# megatron_moe by symlinks, as setup.py maps them on install; PYTHONPATH=$PWD), and helpers they
# share. Optional: wheels put in .whl/ (e.g. megatron-core, for a machine without a package
# index) are installed into /tmp/site first; a Triton carried in .tri/ (benchmarks/triton_bundle.sh) is
# unpacked and put first on the path. An installed megatron-moe works as well. The wheels
# the GPU stages use (megatron-core and pydantic for the model tests and Megatron-LM; pytest-xdist
# for the test stages' workers), fetched where there is an index:
#   pip download -d .whl --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
#     megatron-core==0.16.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types \
#     typing-inspection typing-extensions pytest-xdist execnet
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ls .tri/triton-*.tar.xz >/dev/null 2>&1; then  # a carried Triton (benchmarks/triton_bundle.sh), first on the path
  tri_tar=$(ls .tri/triton-*.tar.xz | head -n 1); tri_dir=/tmp/tri-$(basename "$tri_tar" .tar.xz)
  [[ -d $tri_dir/triton ]] || { mkdir -p "$tri_dir" && tar xJf "$tri_tar" -C "$tri_dir"; } || exit 1
  # its backends found in its own tree: the entry points of the installed Triton name an AMD backend the bundle lacks
  export PYTHONPATH=$tri_dir${PYTHONPATH:+:$PYTHONPATH} TRITON_BACKENDS_IN_TREE=1
fi
for d in kernels tools; do [[ -e megatron_moe/$d ]] || ln -sfn ../$d megatron_moe/$d; done
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

write_env() {  # FILE: the GPUs, torch / Triton / CUDA versions and the UTC date
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
    date -u +%Y-%m-%dT%H:%M:%SZ; } > "$1" 2>&1
  # processes of an earlier command still holding a GPU (one hung at exit, say) make the timings
  # that follow incomparable and can run them out of memory: said in FILE and on stderr
  local busy
  busy=$(nvidia-smi --query-compute-apps=pid,gpu_bus_id,used_memory --format=csv,noheader 2>/dev/null | tr '\n' ';')
  [[ -n $busy ]] && echo "WARNING: processes already on the GPUs (pid, bus, memory): $busy" | tee -a "$1" >&2
  return 0
}

split_overrides() {  # "a=1,mb=32,B=2" DEFAULT_MB: sets mb (mb=N, else DEFAULT_MB), env_extra (upper-case
  local o             # NAME=value: environment variables, e.g. kernel switches) and extra (the rest)
  mb=$2; extra=(); env_extra=()
  for o in ${1//,/ }; do
    if [[ $o == mb=* ]]; then mb=${o#mb=}
    elif [[ $o =~ ^[A-Z][A-Z0-9_]*= ]]; then env_extra+=("$o")
    else extra+=("$o"); fi
  done
}
