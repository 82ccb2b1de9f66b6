#!/usr/bin/env bash
# Every check that needs CUDA, in one run on a CUDA machine: the CUDA-marked tests, the CUDA
# benchmarks and, where 2+ GPUs are visible, the 2-GPU distributed checks. Without a CUDA
# device it says so and exits 0; otherwise it exits 1 when any section failed.
# Each section is self-contained and boxed by `timeout`; on one GPU the boxes add up to 460 s,
# under 8 minutes with the bitsandbytes wheel install. A new check is a new section (keep the
# whole script under 8 minutes). Benchmarks write benchmarks/results/*_cuda.md (long context:
# *_cuda.jsonl); every section's output is appended to benchmarks/results/gpu_check.log.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
command -v "$PY" >/dev/null 2>&1 || PY=python3  # a path or a command name (PY=python)
LOG=benchmarks/results/gpu_check.log
mkdir -p benchmarks/results

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device visible to torch ($("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)); nothing to check."
  exit 0
fi
"$PY" -c "import torch; print('gpu_check:', torch.cuda.get_device_name(), 'torch', torch.__version__)" | tee "$LOG"
# bitsandbytes from the wheel benchmarks/gpu_wheels.sh downloaded, when the machine lacks it
if ! "$PY" -c "import bitsandbytes" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  "$PY" -c "import bitsandbytes as b; print('gpu_check: bitsandbytes', b.__version__, 'from .whl/')" \
    | tee -a "$LOG"
fi
status=0

section() { echo; echo "=== $1 ===" | tee -a "$LOG"; }
# an output filter (grep's arguments): showing no line is not a failure. grep exits 1 when no
# line matches, which pipefail would turn into the section's failure; the command's own exit
# status still fails the pipeline (tests/qlora/test_longctx_gpu_script.py)
only() { grep "$@" || true; }

# --- paged optimizer: its CUDA tests, then the comparison with torch and bitsandbytes ------
section "paged optimizer: CUDA tests"
timeout 100 "$PY" -m pytest -q -m cuda tests/optim/test_adamw_cuda.py 2>&1 | tee -a "$LOG" \
  | tail -3 || status=1
section "paged optimizer: CUDA benchmark vs torch fused and bitsandbytes PagedAdamW"
timeout 60 "$PY" benchmarks/optimizer_cuda.py 2>&1 | tee -a "$LOG" | tail -12 || status=1

# --- every other CUDA-marked test under tests/ (keep them fast: one 80 s box) ---------------
section "other CUDA tests"
timeout 80 "$PY" -m pytest -q -m cuda tests --deselect tests/optim/test_adamw_cuda.py \
  2>&1 | tee -a "$LOG" | tail -5 || status=1

# --- append further GPU checks here: section "..."; timeout N command || status=1 -----------

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

# --- end to end: tightfit stack vs HF stack on the GPU (bf16), peak + step time -------------
section "e2e: tightfit vs HF + bitsandbytes + peft stack on CUDA"
timeout 60 "$PY" benchmarks/e2e.py --out benchmarks/results/e2e_cuda.md 2>&1 | tee -a "$LOG" \
  | tail -8 || status=1

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
else
  section "distributed: skipped (${NGPU:-0} GPU visible; the 2-GPU FSDP2 case needs 2)"
fi

echo
echo "gpu_check: done (status $status); log in $LOG"
exit $status
