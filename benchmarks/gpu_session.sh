#!/bin/bash
# One GPU lease: the GPU benchmark presets of benchmarks/README.md ("GPU session"), results under $OUT.
#
#   bash .gpu/session.sh full     # ~6 min on one H200 (at most 8 min: the parts' timeouts, 450 s, + ~25 s setup)
#   bash .gpu/session.sh smoke    # ~2 min: installs, versions, card, a tiny CUDA run of each part + 2 real cells
#   DEVICE=cpu bash benchmarks/gpu_session.sh smoke          # CPU dry run of the smoke (tiny shapes only)
#   DEVICE=cpu TINY=1 bash benchmarks/gpu_session.sh full    # CPU dry run of the full call's commands, --tiny added
#
# On the device machine this runs from the lead's checkout with `carry: [".whl", ".gpu"]`: .whl holds the wheels the
# image lacks (installed into /tmp/site, first on PYTHONPATH; hf_dp itself comes from the checkout), .gpu holds this
# script and benchmarks/gpu_llm.py (copied into benchmarks/ when the checkout has none yet). Each part runs under its
# own `timeout` and writes its JSON/markdown when it ends; the whole log is $OUT/log.
set -o pipefail
MODE=${1:-full}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/gpu_session_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_PROGRESS_BARS=1
T0=$(date +%s)
stamp() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }

main() {
  if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    stamp "installing wheels"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || { echo "wheel install failed"; return 1; }
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD
  fi
  [ -f benchmarks/gpu_llm.py ] || cp .gpu/gpu_llm.py benchmarks/gpu_llm.py
  stamp "environment"
  nvidia-smi -L 2>&1
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1
  python3 - <<'EOF' 2>&1 | grep -v kernels-community
import importlib, torch
print("python3", __import__("sys").version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device:", torch.cuda.get_device_name(0), "|", p.multi_processor_count, "SMs |",
          f"{p.total_memory / 2**30:.1f} GiB | capability {p.major}.{p.minor}")
for name in ("transformers", "accelerate", "peft", "datasets", "prv_accountant", "dp_accounting", "opacus",
             "bitsandbytes", "huggingface_hub", "tokenizers", "numpy", "scipy", "dill", "multiprocess", "fsspec",
             "pyarrow", "attr", "hf_dp"):
    try:
        m = importlib.import_module(name)
        print(f"  {name} {getattr(m, '__version__', '?')} ({m.__file__})")
    except Exception as exc:  # noqa: BLE001
        print(f"  {name}: IMPORT FAILED: {type(exc).__name__}: {exc}")
EOF
  local RUN="python3 benchmarks/run.py --device $DEVICE --preset gpu --no-memory"
  local DPM="--methods nonprivate flat per_layer opacus_ghost opacus_hooks"
  local LLM="python3 benchmarks/gpu_llm.py --device $DEVICE"
  local TINYFLAG=${TINY:+--tiny}
  if [ "$MODE" = smoke ]; then
    stamp "part 1 (tiny): run.py --preset gpu --tiny"
    timeout 60 $RUN --tiny $DPM --repeats 1 --steps 1 --shapes gpt2-small-T128 gpt2-small-T128-untied \
      bert-base-cls-T128 --out "$OUT/run_tiny.json" --markdown "$OUT/run_tiny.md"
    stamp "part 2 (tiny): gpu_llm.py --tiny, full / LoRA / QLoRA, checkpointing on"
    timeout 60 $LLM --tiny --checkpointing-options on --json "$OUT/llm_tiny.json" --markdown "$OUT/llm_tiny.md"
    if [ "$DEVICE" = cuda ]; then
      stamp "part 1 (one real shape, calibration): gpt2-small-T512-untied, 1 repeat"
      timeout 45 $RUN $DPM --repeats 1 --steps 2 --shapes gpt2-small-T512-untied
      stamp "part 2 (one real cell pair, calibration): 16 x 2048 Llama, T=2048 B=8, full, no checkpointing"
      timeout 45 $LLM --shapes 2048:8 --variants full --checkpointing-options off
    fi
  else
    # Part 1 (~2.5 min on an H200): the 5 shapes of --preset gpu, 5 methods, fp32 (the harness's setting), 1 repeat
    # of 1 warm-up + 3 timed steps per method, peak torch.cuda.max_memory_allocated; in two invocations (T = 128
    # shapes, then T = 512) so that a timeout keeps the first one's files.
    stamp "part 1a: run.py --preset gpu, T=128 shapes (GPT-2 small B=16 tied/untied, BERT-base cls B=32)"
    timeout 120 $RUN $TINYFLAG $DPM --repeats 1 --steps 3 --warmup 1 --shapes gpt2-small-T128 \
      gpt2-small-T128-untied bert-base-cls-T128 --out "$OUT/run_T128.json" --markdown "$OUT/run_T128.md"
    echo "part 1a exit $?"
    stamp "part 1b: run.py --preset gpu, T=512 shapes (GPT-2 small B=8 tied/untied)"
    timeout 90 $RUN $TINYFLAG $DPM --repeats 1 --steps 3 --warmup 1 --shapes gpt2-small-T512 gpt2-small-T512-untied \
      --out "$OUT/run_T512.json" --markdown "$OUT/run_T512.md"
    echo "part 1b exit $?"
    # Part 2 (~3 min): a 1.2 B Llama-style model (16 × 2048, MLP 8192, vocab 32 k), bf16 mixed precision, 1 warm-up +
    # 2 timed steps: T = 2048 B = 8, full / LoRA / QLoRA (nf4) × checkpointing off / on × non-private / flat; then
    # T = 4096 B = 4 with checkpointing on only.
    stamp "part 2a: gpu_llm.py, 16 x 2048 Llama, T=2048 B=8"
    timeout 150 $LLM $TINYFLAG --shapes 2048:8 --json "$OUT/llm_T2048.json" --markdown "$OUT/llm_T2048.md"
    echo "part 2a exit $?"
    stamp "part 2b: gpu_llm.py, 16 x 2048 Llama, T=4096 B=4, checkpointing on"
    timeout 90 $LLM $TINYFLAG --shapes 4096:4 --checkpointing-options on --json "$OUT/llm_T4096.json"
    echo "part 2b exit $?"
  fi
  stamp "done"
}

main 2>&1 | tee "$OUT/log"
