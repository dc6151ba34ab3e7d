# Sourced by the GPU measuring scripts: what every process they start must carry, and a step header.
# NVLink multicast (NVLS) can take a shared host's GPUs out of service: it stays off in every
# process, and the sweep sees NCCL_NVLS_ENABLE=0 as a pinned variable.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
step() { echo; echo "=== $* ($(date +%T))"; }
# CUDA MPS for ranks that share one GPU (NCCL hosts on one GPU): mps_start DIR runs the control
# daemon with its pipe and log directories under DIR and exports them for every process started
# after it; it changes no GPU setting. SHARING says how the ranks share the GPU, for every output:
# concurrently under MPS, or time-sliced (and why) where MPS is refused. mps_stop quits the daemon.
SHARING="ranks time-slice the one GPU (no CUDA MPS)"
mps_start() {
  local dir=$1 ctl
  ctl=$(command -v nvidia-cuda-mps-control) || { SHARING="$SHARING: nvidia-cuda-mps-control not found"; return 1; }
  mkdir -p "$dir/pipe" "$dir/log"
  export CUDA_MPS_PIPE_DIRECTORY=$dir/pipe CUDA_MPS_LOG_DIRECTORY=$dir/log
  if "$ctl" -d && for _ in $(seq 50); do [ -e "$dir/pipe/control" ] && break; sleep 0.1; done && [ -e "$dir/pipe/control" ]; then
    SHARING="ranks run concurrently under CUDA MPS (pipe directory $dir/pipe)"
    return 0
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  SHARING="ranks time-slice the one GPU: CUDA MPS refused to start (see $dir/log)"
  return 1
}
mps_stop() {
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
