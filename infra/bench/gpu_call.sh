#!/usr/bin/env bash
# One device call's measurements for the rollout engine (issue 18), packed into $OUT/<plan>.tgz: a call returns at
# most 8 files, and one of these runs writes a dozen. Each step gets what is left of the call's budget (a step that
# overruns is stopped, its log kept); a step with too little left is skipped with a line. The last lines of every
# log are printed at the end, so the call's reply shows the numbers even if the archive does not come back.
#
#   on the device, carrying .devkit:   bash infra/bench/gpu_call.sh next
#   here, the commands it would run:   bash infra/bench/gpu_call.sh --print next
#
# Plans: next (fp8's projections, the A/Bs, 7B fp8, ragged), attention (the decode attention's micro-benchmarks beside
# a read of the same bytes, and the engine's timing of its kernels), families (the other families at their real sizes),
# big (7B and Qwen3-8B, fp8 and the fp8 cache), e2e (the pipeline: the shipped blueprint, today's and the previous),
# tests (the CUDA tests), agent (multi-turn rollouts against single-turn, the turn cache on and off; then
# rollout.weights=auto's check), async (issue 42: one-step-off rollouts
# against on-policy on 2 and on 8 GPUs, kind nvidia-h100-x8 or nvidia-h200-x8; ASYNC_GPUS picks the counts), multi
# (issue 42: the shipped blueprint on 1/2/4/8 GPUs and 7B on 8, for the memory and scaling tables).
# BUDGET_S (default 560) is the call's seconds: a command may run 600.
set -uo pipefail
print=0
if [ "${1:-}" = --print ]; then print=1; shift; fi
plans="next attention families big e2e tests agent async multi memplan"
plan=${1:?usage: gpu_call.sh [--print] PLAN, one of: $plans}
case " $plans " in
  *" $plan "*) ;;
  *) echo "unknown plan $plan: one of $plans" >&2; exit 2 ;;
esac
budget=${BUDGET_S:-560}
R=${GPU_CALL_DIR:-/tmp/gpu_call/$plan}

step() {  # step NAME CMD...: CMD in what is left of the budget, its output in $R/NAME.log
  local name=$1
  shift
  if [ $print = 1 ]; then printf '%q ' "$@"; echo; return 0; fi
  local left=$((budget - SECONDS - 15))  # 15 s to pack the archive
  if [ $left -lt 30 ]; then echo "$name: skipped, ${left} s left" | tee -a "$R/steps.txt"; return 0; fi
  local t0=$SECONDS
  timeout -k 5 "$left" "$@" > "$R/$name.log" 2>&1
  echo "$name: rc $? in $((SECONDS - t0)) s" | tee -a "$R/steps.txt"
}

pack() {
  echo "== steps"; cat "$R/steps.txt" 2>/dev/null
  for f in "$R"/*.log; do [ -e "$f" ] && { echo "== $(basename "$f") (last lines)"; tail -n 25 "$f"; }; done
  tar czf "$OUT/$plan.tgz" -C "$R" . && echo "packed $OUT/$plan.tgz"
}

if [ $print = 0 ]; then
  : "${OUT:?set OUT, the folder whose files come back}"
  mkdir -p "$R"
  bash .devkit/unpack.sh > /dev/null || { echo "no .devkit: run ../shared/gpu/build-kit.sh and carry .devkit"; exit 2; }
  # the package is imported as verlflow.*: link its folders under that name
  mkdir -p /tmp/vf/verlflow && for d in core tasks flows; do ln -sfn "$PWD/$d" "/tmp/vf/verlflow/$d"; done
  export PYTHONPATH=/tmp/devsite:/tmp/vf:$PWD VERLFLOW_ALLOW_UNTESTED_VERSIONS=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
  export NCCL_NVLS_ENABLE=0
  trap pack EXIT
  nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > "$R/gpu.txt" 2>&1
fi

case $plan in
  next)
    # each fp8 projection against bf16 at the decode step's shape
    step fp8_gemm python infra/bench/fp8_gemm.py --shape 1.5b --json "$R/fp8_gemm.json"
    # fp8 against bf16; the attention A/B; PDL and GEMM autotuning; the step's kernel table
    step ab15 python infra/bench/rollout.py --shape 1.5b --skip-baseline --no-variants --no-micro --ab-fp8 --ab-attn \
      --fp8-variants fp8 --ab-inductor '{"triton.enable_pdl": true}' \
      --ab-inductor '{"max_autotune_gemm": true}' --tf-rows 8 --profile --out "$R" --json "$R/ab15.json"
    step ab7 python infra/bench/rollout.py --shape 7b --skip-baseline --no-variants --no-micro --ab-fp8 \
      --fp8-variants fp8 --tf-rows 8 --json "$R/ab7.json"
    step ragged python infra/bench/ragged.py --json "$R/ragged.json"
    step ragged_kv8 python infra/bench/ragged.py --kv-cache fp8 --json "$R/ragged_kv8.json"
    ;;
  attention)
    step attention python infra/bench/rollout.py --shape 1.5b --skip-baseline --no-variants --ab-attn --tf-rows 8 \
      --budget-s 450 --json "$R/attention.json"
    ;;
  families)
    step families python infra/bench/rollout.py --shape llama3.2-1b --shape gemma3-1b --shape olmo2-1b \
      --shape gemma2-2b --shape phi3-mini --shape mistral-7b --no-hf-static --no-variants --no-micro --tf-rows 8 \
      --budget-s 500 --json "$R/families.json"
    ;;
  big)
    step big python infra/bench/rollout.py --shape 7b --shape qwen3-8b --skip-baseline --no-variants --no-micro \
      --ab-fp8 --fp8-variants fp8,kv8 --tf-rows 8 --budget-s 480 --json "$R/big.json"
    ;;
  e2e)
    mkdir -p /dev/shm/vf 2> /dev/null
    # the GPU image has no mlflow: tracking off (the blueprint's default backend would stop the run at validate).
    # The blueprint as shipped first (its first iteration pays the cold compiles, as on a fresh machine), then as
    # shipped on 2026-12-06 on the same card; each stage's measured peak beside the memory plan's
    step e2e python infra/bench/e2e.py --configs "${E2E_CONFIGS:-shipped,shipped_2026_12_06}" \
      --iterations "${E2E_ITERATIONS:-2}" --root /tmp/e2e \
      --store /dev/shm/vf --set 'tracking.backends=[]' --json "$R/e2e.json" --log "$R/e2e"
    ;;
  memplan)
    mkdir -p /dev/shm/vf 2> /dev/null
    # issue 41: the memory plan's peaks beside the measured ones at 7B with LoRA on one GPU (a short rollout: the
    # plan is computed for the same settings, so the comparison holds), then 0.5B as shipped
    step lora_7b python infra/bench/e2e.py --configs shipped --shape 7b --prompts 64 --new-tokens 256 --iterations 1 \
      --root /tmp/e2e --store /dev/shm/vf/7b --set 'tracking.backends=[]' --set 'model.lora={rank: 16}' \
      --json "$R/lora_7b.json" --log "$R/lora_7b"
    ;;
  multi)
    mkdir -p /dev/shm/vf 2> /dev/null
    # issue 42 section 1: the shipped blueprint on 1, 2, 4, 8 GPUs of one node (validate's fsdp_shard and gradient
    # checks on NCCL; each stage's per-card memory in its manifest; tok/s/GPU for the scaling table), then 7B full
    # fine-tune on 8. One count per call when the budget is short: MULTI_GPUS="4 8", MULTI_7B=0.
    for g in ${MULTI_GPUS:-1 2 4 8}; do
      step "shipped_${g}gpu" python infra/bench/e2e.py --configs shipped --gpus "$g" --iterations "${E2E_ITERATIONS:-2}" \
        --root /tmp/e2e --store "/dev/shm/vf/g$g" --set 'tracking.backends=[]' --json "$R/shipped_${g}gpu.json" \
        --log "$R/shipped_${g}gpu"
    done
    if [ "${MULTI_7B:-1}" = 1 ]; then
      step shipped_7b_8gpu python infra/bench/e2e.py --configs shipped --shape 7b --gpus 8 --iterations 2 \
        --root /tmp/e2e --store /dev/shm/vf/7b --set 'tracking.backends=[]' --json "$R/shipped_7b_8gpu.json" \
        --log "$R/shipped_7b_8gpu"
    fi
    ;;
  async)
    mkdir -p /dev/shm/vf 2> /dev/null
    # issue 42: tok/s/GPU of one-step-off rollouts (half the node's GPUs sample update[i-1]'s policy while the other
    # half train update[i]) against on-policy with the same loss on all of them, at 1.5B; 3 iterations, so that two
    # overlap. The model is random (rewards ~0): whether rewards still rise needs the real model, a longer run.
    # One GPU count per call when the budget is short: ASYNC_GPUS=2, then ASYNC_GPUS=8.
    for g in ${ASYNC_GPUS:-2 8}; do
      step "async_${g}gpu" python infra/bench/e2e.py --configs onpolicy_corrected,async --gpus "$g" \
        --iterations "${E2E_ITERATIONS:-3}" --root /tmp/e2e --store /dev/shm/vf --set 'tracking.backends=[]' \
        --json "$R/async_${g}gpu.json" --log "$R/async_${g}gpu"
    done
    ;;
  agent)
    # issue 40: agent-mode tok/s against single-turn at the same model-token count, tool latency 0/50/500 ms
    [ "${AGENT_4X256:-1}" = 1 ] && step agent python infra/bench/agent.py --json "$R/agent.json"
    # issue 41: rollout.weights=auto's timed check at 1.5B and 7B, 256 and 640 rows (what it would choose)
    step weights_auto python infra/bench/weights_auto.py --json "$R/weights_auto.json"
    # the same tokens in 2 turns of 512: half the turns, so about half the contexts prefilled again
    step agent_2x512 python infra/bench/agent.py --turns 2 --turn-tokens 512 --latency-ms 50 --json "$R/agent_2x512.json"
    ;;
  tests)
    # the engine's CUDA tests (named *cuda*), then every test of the Triton kernels' file (none is named cuda: they
    # run the kernels interpreted and compile them for sm_90, which the GPU image's Triton does as well)
    step tests python -m pytest -q tests/test_fastgen.py tests/test_fastgen_families.py tests/test_fastgen_fp8.py \
      tests/test_fastgen_kv8.py -k cuda
    step triton_tests python -m pytest -q tests/test_triton_kernels.py
    ;;
esac
