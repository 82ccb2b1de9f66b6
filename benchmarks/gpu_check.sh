#!/usr/bin/env bash
# Every CUDA path once, in one run on a CUDA machine: the paged step (resident, streamed,
# 8-bit; host syncs counted), activation offload + prefetch against no offload, an OOM retried
# in step() and in backward, the CUDA-marked tests, the CUDA optimizer benchmark, the
# long-context probe, and, where 2+ GPUs are visible, the 2-GPU DDP/FSDP2 checks. Without a
# CUDA device it says so and exits 0; otherwise it exits 1 when any section failed.
#
# Each section is its own process boxed by `timeout`, so a sticky CUDA error (an illegal
# address poisons the process's context) or a hang ends that section only, and the next one
# starts with a fresh context. Results are written as they come: each case of the
# benchmarks/gpu_sections.py sections is a JSON line in benchmarks/results/gpu_check.jsonl the
# moment it is measured, every section's output is appended to benchmarks/results/gpu_check.log,
# and the long-context probe writes benchmarks/results/long_context_cuda.jsonl line by line.
# On one GPU the boxes add up to 15 + 40 + 45 + 25 + 60 + 90 + 40 + 160 = 475 s, under
# 8 minutes (the e2e comparison, benchmarks/e2e.py, does not fit: run it on its own).
# The sections' Python code runs on the CPU under the strict CUDA emulation in CI
# (tests/test_gpu_check.py: gpu_sections.py --emulate).
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
command -v "$PY" >/dev/null 2>&1 || PY=python3  # a path or a command name (PY=python)
LOG=benchmarks/results/gpu_check.log
RESULTS=benchmarks/results/gpu_check.jsonl
mkdir -p benchmarks/results

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device visible to torch ($("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)); nothing to check."
  exit 0
fi
: >"$RESULTS"
"$PY" -c "import torch; print('gpu_check:', torch.cuda.get_device_name(), 'torch', torch.__version__)" | tee "$LOG"
status=0

section() { echo; echo "=== $1 ===" | tee -a "$LOG"; }
# an output filter (grep's arguments): showing no line is not a failure. grep exits 1 when no
# line matches, which pipefail would turn into the section's failure; the command's own exit
# status still fails the pipeline (tests/qlora/test_longctx_gpu_script.py)
only() { grep "$@" || true; }

# --- bitsandbytes from the carried wheel (benchmarks/gpu_wheels.sh downloads it into .whl/;
# a lent machine has torch, transformers and peft but not bitsandbytes, and no network) -----
if ! "$PY" -c "import bitsandbytes" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  section "bitsandbytes from .whl/"
  timeout 15 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl 2>&1 | tee -a "$LOG" || status=1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  "$PY" -c "import bitsandbytes as b; print('gpu_check: bitsandbytes', b.__version__, 'from .whl/')" \
    2>&1 | tee -a "$LOG" || status=1
fi

# --- the CUDA paths, a process each: JSON lines in $RESULTS as each case ends ----------------
run_section() {  # name, timeout in seconds
  section "$1 (benchmarks/gpu_sections.py $1)"
  timeout "$2" "$PY" benchmarks/gpu_sections.py "$1" --out "$RESULTS" 2>&1 | tee -a "$LOG" \
    | only "^gpu_sections:\|Error" | tail -8 || status=1
}
run_section paged 40         # resident / streamed / foreach / 8-bit: parity and syncs a step
run_section offload 45       # every block offloaded to pinned host + prefetched vs none
run_section oom_step 25      # an OOM in the fused kernel at step 2: retried, equal to clean
run_section oom_backward 60  # an OOM in a backward of tightfit train: retried, same adapter

# --- every CUDA-marked test under tests/ (one box; a GPU runs their cuda variants) ----------
section "CUDA tests"
timeout 90 "$PY" -m pytest -q -m cuda tests 2>&1 | tee -a "$LOG" | tail -5 || status=1

section "paged optimizer: CUDA benchmark vs torch fused and bitsandbytes PagedAdamW"
timeout 40 "$PY" benchmarks/optimizer_cuda.py 2>&1 | tee -a "$LOG" | tail -12 || status=1

# --- long context: Llama-3.1-8B shape, random weights, NF4 + DQ, LoRA r=32, batch 1,
# under a 24 GiB cap (set_per_process_memory_fraction): the longest sequence a training step
# completes (doubling from 32k, bisection to 8k, 50 s of probes a stack), tightfit.plan's
# predicted longest beside it, tokens/s, and the same for the HF stack (the reference to pass:
# Unsloth's 78,475 tokens). The model is built once per stack, layer by layer on the GPU. The
# same code path runs on the CPU with a tiny config (tests/qlora/test_longctx_gpu_script.py);
# the 160 s box is an estimate, not a measured time.
section "long context: 8B shape under a 24 GiB cap, tightfit vs HF (longest sequence)"
timeout 160 "$PY" benchmarks/long_context_gpu.py --start 32768 --resolution 8192 \
  --limit 98304 --box 50 --out benchmarks/results/long_context_cuda.jsonl 2>&1 \
  | tee -a "$LOG" | only -v "^Loading\|^Writing" | tail -12 || status=1

# --- distributed: 2-GPU FSDP2/DDP with PagedAdamW, NCCL; only with >= 2 GPUs ---------------
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${NGPU:-0}" -ge 2 ]; then
  DIST_OUT=$(mktemp -d)
  free_port() { "$PY" -c "from tightfit.distributed.launch import free_port; print(free_port())"; }
  section "distributed: FSDP2 on 2 GPUs, PagedAdamW vs torch AdamW, DCP save/resume, 2 -> 1 rank"
  timeout 150 "$PY" -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 \
    --master_port "$(free_port)" -m tightfit.distributed.selfcheck --strategy fsdp \
    --device cuda --out "$DIST_OUT/fsdp" 2>&1 | tee -a "$LOG" | only "selfcheck" || status=1
  timeout 90 "$PY" -m tightfit.distributed.selfcheck --strategy fsdp --device cuda \
    --out "$DIST_OUT/fsdp" --resume-only 2>&1 | tee -a "$LOG" | only "selfcheck" || status=1
  section "distributed: FSDP2 on 2 GPUs with PagedAdamW8bit (bitsandbytes' CUDA kernel)"
  # 8-bit vs the fp32 reference differs by quantization: the CPU run's max abs diff was 8.2e-4
  timeout 120 "$PY" -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 \
    --master_port "$(free_port)" -m tightfit.distributed.selfcheck --strategy fsdp \
    --optim paged8bit --tol 3e-3 --device cuda --out "$DIST_OUT/fsdp8" 2>&1 | tee -a "$LOG" \
    | only "selfcheck" || status=1
  section "distributed: DDP on 2 GPUs"
  timeout 120 "$PY" -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 \
    --master_port "$(free_port)" -m tightfit.distributed.selfcheck --strategy ddp \
    --device cuda --out "$DIST_OUT/ddp" 2>&1 | tee -a "$LOG" | only "selfcheck" || status=1
  section "distributed: tightfit train --fsdp on 2 GPUs (QLoRA stack, paging budget)"
  timeout 180 "$PY" -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 \
    --master_port "$(free_port)" -m tightfit.cli train --fsdp --steps 6 --save-every 3 \
    --batch-size 4 --seq-len 64 --device-budget 256KiB --page-bytes 64KiB \
    --out "$DIST_OUT/train" 2>&1 | tee -a "$LOG" | tail -12 || status=1
  rm -rf "$DIST_OUT"
  section "distributed: the 4-bit base sharded by FSDP2 (benchmarks/gpu_check_fsdp.sh)"
  timeout 420 bash benchmarks/gpu_check_fsdp.sh 2>&1 | tee -a "$LOG" | tail -20 || status=1
else
  section "distributed: skipped (${NGPU:-0} GPU visible; the 2-GPU FSDP2/DDP cases need 2)"
fi

echo
echo "gpu_check: done (status $status); log in $LOG, results in $RESULTS"
exit $status
