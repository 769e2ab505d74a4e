#!/usr/bin/env bash
# Every check that needs a GPU, in one go, as run on a lent GPU machine (README "What ran on a GPU").
#
#     bash bench/gpu_checks.sh [OUT_DIR [CHECK...]]   # python3 there must hold a CUDA torch and nvidia-ml-py
#
# CHECK: nvml_probe, nccl_reform, gpu_guard, checkpoint_speed, integration_checkpoint,
# checkpoint_speed_8g (default: all but the last).
#
# No install (bench/source_tree.sh): spotguard's folders are copied into the layout the package has
# under a temporary directory put first on PYTHONPATH, so the machine's own torch is the one used.
# Each check's output is also written to OUT_DIR (default: a temporary directory).
set -u
cd "$(dirname "$0")/.."
out="${1:-$(mktemp -d)}"
shift || true
checks=" ${*:-nvml_probe nccl_reform gpu_guard checkpoint_speed integration_checkpoint} "
mkdir -p "$out"
source bench/source_tree.sh
status=0
run() {  # run NAME SECONDS COMMAND...: one check, its output kept, its exit status remembered
    local name="$1" limit="$2"; shift 2
    [[ "$checks" == *" $name "* ]] || return 0
    echo "=== $name: $*"
    local started=$SECONDS
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    local rc=$?
    grep -v -e '^\s*$' "$out/$name.txt" | tail -n 60
    echo "=== $name: exit $rc after $((SECONDS - started)) s"
    [ "$rc" -eq 0 ] || status=1
}
nvidia-smi -L
python3 -c "import torch, pynvml; print('torch', torch.__version__, 'NCCL', torch.cuda.nccl.version(), 'nvidia-ml-py', getattr(pynvml, '__version__', '?'))"
run nvml_probe 60 python3 bench/nvml_probe.py --seconds 8 --load
run nccl_reform 120 python3 bench/nccl_reform.py
run gpu_guard 200 python3 bench/gpu_guard.py
run checkpoint_speed 200 python3 bench/checkpoint_speed.py --device cuda --skip-deepspeed --size-mb 2048 --repeat 3
run integration_checkpoint 240 python3 bench/integration_checkpoint.py --device cuda --size-mb 2048 --repeat 3
run checkpoint_speed_8g 240 python3 bench/checkpoint_speed.py --device cuda --skip-deepspeed --size-mb 8192 --repeat 1
echo "gpu checks: $([ $status -eq 0 ] && echo 'all passed' || echo 'some FAILED') (outputs in $out)"
exit $status
