# Sourced by the GPU measuring scripts: what every process they start must carry, and a step header.
# NVLink multicast (NVLS) can take a shared host's GPUs out of service: it stays off in every
# process, and the sweep sees NCCL_NVLS_ENABLE=0 as a pinned variable.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
step() { echo; echo "=== $* ($(date +%T))"; }
