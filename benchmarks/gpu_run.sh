#!/usr/bin/env bash
# The decode-step and prefill measurements of one GPU session (issues #28, #29) in two device calls, each inside the
# 10-minute limit; the JSON results and summary.log under $OUT (at most the 8 files the device returns), the full
# logs under /tmp/gpu_run_logs.
#
#   bash benchmarks/gpu_run.sh tests   # GPU tests; first starts llama.cpp's build and model in the background
#   bash benchmarks/gpu_run.sh bench   # the GDN and attention GPU tests, then
#                                      # engine_gpu (dense 1/16/64 with --serial, TurboQuant 1), prefill_gpu
#                                      # (4k and 32k prompts, both cache kinds),
#                                      # a 32k TurboQuant bench, then llama.cpp's llama-bench (tg128, pp512, pp4096)
#   bash benchmarks/gpu_run.sh join    # long_prompt_join: 8 decoding while a 32k prompt joins, both cache kinds
#   bash benchmarks/gpu_run.sh serving # issue #38: the flat step's GPU tests, serving_gpu (POLICIES: a sweep)
#   bash benchmarks/gpu_run.sh server  # the tree before (.base/src) beside, sluice serve over HTTP, TurboQuant
#   bash benchmarks/gpu_run.sh single  # serving, then server, on one GPU
#   bash benchmarks/gpu_run.sh both    # the last two at once on a machine of two GPUs
#   bash benchmarks/gpu_run.sh hardening; bash benchmarks/gpu_run.sh hardening2   # issue #39, two GPUs, two calls
#   bash benchmarks/gpu_run.sh prefix  # issue #41, two GPUs: the prefix cache's GPU tests, the agent trace
#   bash benchmarks/gpu_run.sh paged   # issues #41 (paged KV) and #42 (MLA kernels), four GPUs, four lanes
#   bash benchmarks/gpu_run.sh paged2  # issue #41 again: tests, decode/prefill beside the tree before, server, budget
#   bash benchmarks/gpu_run.sh paged3  # what session 4 left unmeasured: the stall's phases, preemption, the budget
#   bash benchmarks/gpu_run.sh backends  # the attention backends on the GPU, slow steps profiled, the MLA sweep
#   bash benchmarks/gpu_run.sh final     # the GPU tests, HTTP and the agent trace after the stall's fix
#   bash benchmarks/gpu_run.sh deepseek  # issue #42, one GPU: DeepSeek's GPU tests, deepseek_gpu (Moonlight with the
#                                        # fused chain off and on, its 4k prefill, DeepSeek-V3 slices' per-layer times)
#   bash benchmarks/gpu_run.sh mlaprof   # issue #42, one GPU: Moonlight's batch-1 kernels, ncu on its MLA kernels,
#                                        # Qwen3-Next's 4k prefill and batch-1 decode
#   bash benchmarks/gpu_run.sh mma       # issue #43, one GPU: the CUDA MoE GEMM's tests (MMA_TESTS more), then
#                                        # moe_mma_gpu (MMA_ARGS: its options)
#   bash benchmarks/gpu_run.sh tp        # issue #44, 2 or 4 GPUs: the split tests on GPUs, tp_gpu for Qwen3-Next-80B
#                                        # (1 and 2 GPUs), then with 4 GPUs Qwen3.5-397B (4) and Moonlight (1, 2)
#
# Every benchmark runs as `python -m benchmarks run NAME --json FILE ARGS` (benchmarks/registry.py); the JSON files
# are the runner's records (figures under "figures"). Knobs: POLICIES, SCENARIOS, SERVING_S, PROFILE (serving);
# CLIENTS, TQ, TQ_SCENARIOS, BASE (server; BASE=1 with the older tree's src at .base/src).
#
# Carry `.whl` (the wheels: gguf, fastapi, ...) and, for the peer, `.peer` (`cp -r ../shared/peers/llamacpp .peer`);
# both are git-ignored. Make the second call right after the first: the machine and the background build stay only
# while it is held.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_run}
LOG=/tmp/gpu_run_logs
mkdir -p "$OUT" "$LOG"
[ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
CONFIG=benchmarks/configs/qwen3-next-80b-a3b.json

case "${1:-}" in
mma)
  eval timeout ${MMA_TEST_S:-150} python -m pytest -q -rf -p no:cacheprovider tests/test_moe_mma.py ${MMA_TESTS:-} 2>&1 \
    | tee "$LOG/tests_mma.log" | tail -15 > "$OUT/summary.log"
  timeout ${MMA_BENCH_S:-420} python -m benchmarks run moe_mma_gpu --json "$OUT/moe_mma_gpu.json" ${MMA_ARGS:-} \
    > "$LOG/moe_mma.log" 2>&1
  cp "$LOG/moe_mma.log" "$LOG/tests_mma.log" "$OUT/"
  grep -A200 "^MoE experts of one layer" "$LOG/moe_mma.log" >> "$OUT/summary.log"
  ;;
deepseek)
  # the fused chain first, alone, every launch synchronous: where it fails, the traceback names the kernel
  if [ "${DS_PROBE_S:-100}" != 0 ]; then
    CUDA_LAUNCH_BLOCKING=1 timeout ${DS_PROBE_S:-100} python -m sluice bench -m benchmarks/configs/moonlight-16b-a3b.json \
      --load-format dummy --batch 1 --prompt-tokens 64 --gen-tokens 8 --repeats 1 --no-graphs > "$OUT/chain_probe.log" 2>&1
    echo "chain probe rc=$?" | tee "$OUT/summary.log"
  fi
  DS_TESTS=${DS_TESTS:-"tests/test_deepseek_kernels.py tests/test_mla_triton.py tests/test_group_route_triton.py \
    tests/test_deepseek.py -k 'gpu or triton or cuda or fused or chain'"}
  eval timeout ${DS_TEST_S:-150} python -m pytest -q -rf -p no:cacheprovider $DS_TESTS 2>&1 \
    | tee "$LOG/tests_deepseek.log" | tail -5 >> "$OUT/summary.log"
  timeout ${DS_BENCH_S:-480} python -m benchmarks run deepseek_gpu --json "$OUT/deepseek_gpu.json" ${DS_ARGS:-} \
    > "$LOG/deepseek_gpu.log" 2>&1
  grep -B2 -A40 "Traceback" "$LOG/deepseek_gpu.log" | head -80 > "$OUT/deepseek_errors.log"
  cp "$LOG/deepseek_gpu.log" "$LOG/tests_deepseek.log" "$OUT/"
  grep -A20 "^DeepSeek-family decode" "$LOG/deepseek_gpu.log" | tee -a "$OUT/summary.log"
  ;;
mlaprof)  # issue #42, one GPU: Moonlight's batch-1 step kernel by kernel, Nsight Compute on its MLA kernels,
  # and Qwen3-Next-80B's 4k prefill and batch-1 decode beside the numbers before (nothing of its path regressed)
  timeout 120 python -m benchmarks run engine_gpu --json "$OUT/engine_moonlight.json" \
    --config benchmarks/configs/moonlight-16b-a3b.json --batches 1 --kinds dense > "$LOG/engine_moonlight.log" 2>&1
  grep -A40 "^one replayed" "$LOG/engine_moonlight.log" | head -30 | tee "$OUT/summary.log"
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  timeout 150 "$NCU" -k 'regex:_mla_split|_uv_kernel|_mla_prep' -s 120 -c 3 --section SpeedOfLight \
    --section LaunchStats --section Occupancy --section WarpStateStats python -m sluice bench \
    -m benchmarks/configs/moonlight-16b-a3b.json --load-format dummy --batch 1 --prompt-tokens 512 --gen-tokens 8 \
    --repeats 1 > "$OUT/ncu_moonlight.txt" 2>&1
  grep -E "^  [_a-z].*Context|Duration|Registers Per|Grid Size|Warp Cycles Per Issued|Achieved Occ" \
    "$OUT/ncu_moonlight.txt" | tee -a "$OUT/summary.log"
  timeout 150 python -m sluice bench -m $CONFIG --load-format dummy --batch 1 --prompt-tokens 4096 --gen-tokens 64 \
    --repeats 2 --json > "$OUT/bench_qwen3next_4k.json" 2> "$LOG/bench_qwen3next.log"
  python3 -c "import json; r = json.load(open('$OUT/bench_qwen3next_4k.json')); r = r[0] if isinstance(r, list) else r; \
print('Qwen3-Next-80B 4k prefill', round(r['prefill_tok_s']), 'tok/s; decode b1', round(r['decode_tok_s'], 1))" \
    2>&1 | tee -a "$OUT/summary.log"
  ;;
tp)
  NGPU=$(nvidia-smi -L | wc -l)
  timeout 300 python -m pytest -q -rf -p no:cacheprovider tests/test_tensor_parallel.py -k "two_gpus" 2>&1 \
    | tee "$LOG/tests_tp.log" | tail -5 > "$OUT/summary.log"
  timeout 420 python -m benchmarks run tp_gpu --json "$OUT/tp_qwen3next.json" --config $CONFIG --sizes 1,2 \
    --batches 1,16,64 --expert-parallel > "$LOG/tp_qwen3next.log" 2>&1
  if [ "$NGPU" -ge 4 ]; then
    timeout 540 python -m benchmarks run tp_gpu --json "$OUT/tp_397b.json" \
      --config benchmarks/configs/qwen3.5-397b-a17b.json --sizes 4 --batches 1,64 > "$LOG/tp_397b.log" 2>&1
  fi
  for f in "$LOG"/tp_*.log; do grep -B1 -A12 "distinct prompts, sampled" "$f" || tail -20 "$f"; done 2>&1 \
    | tee -a "$OUT/summary.log"
  ;;
tests)
  if [ -d .peer ] && [ ! -e /tmp/peer_started ]; then  # build + GGUF now, on the CPU; a one-token bench to finish
    touch /tmp/peer_started
    setsid bash -c "PEER_BENCH_ARGS='-p 16 -n 1 -r 1' OUT=/tmp/peer_prep bash .peer/run_gpu.sh > /tmp/peer_prep.log 2>&1" \
      < /dev/null > /dev/null 2>&1 &
  fi
  timeout 500 python -m pytest -q -rf -p no:cacheprovider tests/test_gpu_models.py tests/test_gpu_engine.py \
    tests/test_moe_kernels.py tests/test_norm_triton.py tests/test_rope_triton.py tests/test_qmatmul_triton.py \
    tests/test_conv1d_triton.py tests/test_kv_cache.py -k "not demo_model" 2>&1 | tee "$LOG/tests.log" | tail -15 | tee "$OUT/summary.log"
  ;;
bench)
  if [ -d .peer ]; then  # llama.cpp's build done first: a 16-core compile beside the benchmarks would slow their host side
    for _ in $(seq 48); do pgrep -f peer_prep > /dev/null || break; sleep 5; done
    pgrep -f peer_prep > /dev/null && echo "llama.cpp is still being prepared: its bench may hold GPU memory"
  fi
  # the rest of the GPU tests first (the two calls' tests take about 9 minutes together)
  timeout 240 python -m pytest -q -rf -p no:cacheprovider tests/test_gdn_triton.py tests/test_attention_triton.py 2>&1 \
    | tee "$LOG/tests_bench.log" | tail -5 > "$LOG/tests_tail.log"
  timeout 180 python -m benchmarks run engine_gpu --json "$OUT/engine_dense.json" --config $CONFIG --batches 1,16,64 \
    --kinds dense --serial > "$LOG/engine_dense.log" 2>&1
  timeout 60 python -m benchmarks run engine_gpu --json "$OUT/engine_tq.json" --config $CONFIG --batches 1 \
    --kinds turboquant4 > "$LOG/engine_tq.log" 2>&1
  timeout 60 python -m sluice bench -m $CONFIG --load-format dummy --kv-cache turboquant4 --prompt-tokens 32768 \
    --gen-tokens 64 --repeats 1 --json > "$OUT/bench_tq32k.json" 2> "$LOG/bench_tq32k.log"
  timeout 90 python -m benchmarks run prefill_gpu --json "$OUT/prefill.json" --config $CONFIG --prompts 4096,32768 \
    --chunks 4096 > "$LOG/prefill.log" 2>&1
  timeout 90 python -m benchmarks run prefill_gpu --json "$OUT/prefill_tq.json" --config $CONFIG --prompts 4096,32768 \
    --chunks 4096 --kv-cache turboquant4 > "$LOG/prefill_tq.log" 2>&1
  {
    cat "$LOG/tests_tail.log"
    grep -A40 "^KV " "$LOG/engine_dense.log"; grep -A20 "^KV " "$LOG/engine_tq.log"; grep -A3 "chunk " "$LOG/prefill.log" "$LOG/prefill_tq.log"
    python3 -c "import json; r = json.load(open('$OUT/bench_tq32k.json')); r = r[0] if isinstance(r, list) else r; \
print('turboquant4 32k: decode', round(r['decode_tok_s'], 1), 'tok/s, floor', round(r['floor_decode_tok_s']))"
  } 2>&1 | tee "$OUT/summary.log"
  if [ -d .peer ]; then  # reuses the build and the GGUF of the background run
    OUT=/tmp/llama_out timeout 120 bash .peer/run_gpu.sh > "$LOG/llamacpp.log" 2>&1
    cp /tmp/llama_out/llamacpp.json "$OUT/" 2>/dev/null
    tail -8 "$LOG/llamacpp.log" | tee -a "$OUT/summary.log"
  fi
  ;;
join)
  for kind in dense turboquant4; do
    timeout 240 python -m benchmarks run long_prompt_join --json "$OUT/join_$kind.json" --model $CONFIG \
      --load-format dummy --kv-cache $kind --decode-prefill-chunk 64 512 > "$LOG/join_$kind.log" 2>&1
    tail -4 "$LOG/join_$kind.log" | tee -a "$OUT/summary.log"
  done
  ;;
serving)  # issue #38: the flat step's GPU tests, then what a user gets in one process (a sweep of step budgets)
  S="$OUT/summary_serving.log"
  timeout 300 python -m pytest -q -rf -p no:cacheprovider tests/test_gpu_engine.py \
    "tests/test_gdn_triton.py::test_flat_step_kernels_match_each_sequence_alone" > "$LOG/tests.log" 2>&1
  grep -E "^(FAILED|ERROR|E  )|passed|failed" "$LOG/tests.log" | head -40 > "$S"
  timeout ${SERVING_S:-330} python -m benchmarks run serving_gpu --json "$OUT/serving_dense.json" --model $CONFIG \
    --policies ${POLICIES:-default} ${PROFILE:+--profile "$OUT/profile_closed.txt"} \
    --scenarios ${SCENARIOS:-decode,prefill,closed,burst,join} > "$LOG/serving_dense.log" 2>&1 || tail -25 "$LOG/serving_dense.log" >> "$S"
  tail -20 "$LOG/serving_dense.log" >> "$S"
  ;;
server)  # issue #38: the tree before (.base/src: decode and prefill) in the same session, sluice serve over HTTP,
  # TurboQuant in one process
  S="$OUT/summary_server.log"
  if [ -n "${BASE:-}" ]; then
    PYTHONPATH=/tmp/site:.base/src SLUICE_BENCH_COMMIT="base ($BASE)" timeout 110 python -m benchmarks run \
      serving_gpu --json "$OUT/serving_base.json" --model $CONFIG --baseline > "$LOG/serving_base.log" 2>&1 || tail -20 "$LOG/serving_base.log" >> "$S"
    tail -6 "$LOG/serving_base.log" >> "$S"
  fi
  for clients in ${CLIENTS:-64 16}; do
    timeout $((clients == 64 ? 200 : 120)) python -m benchmarks run server_load --json "$OUT/server_load_$clients.json" \
      --model $CONFIG --load-format dummy --device cuda --endpoint completions --clients $clients --prompts $clients \
      --max-tokens 64 --duration 30 --temperature 1 --max-batch 64 --server-log "$OUT/server_load_$clients.server.log" \
      > "$LOG/server_load_$clients.log" 2>&1 \
      || tail -20 "$LOG/server_load_$clients.log" >> "$S"
    grep -E '"(completion_tokens_per_s|ttft_p50_s|ttft_p99_s|errors|requests)"' "$LOG/server_load_$clients.log" \
      | tr -d '\n' | sed "s/^/HTTP $clients clients: /" >> "$S"; echo >> "$S"
  done
  if [ "${TQ:-1}" = 1 ]; then
    timeout 170 python -m benchmarks run serving_gpu --json "$OUT/serving_tq.json" --model $CONFIG \
      --kv-cache turboquant4 --scenarios ${TQ_SCENARIOS:-closed,burst,join} > "$LOG/serving_tq.log" 2>&1 || tail -60 "$LOG/serving_tq.log" >> "$S"
    tail -5 "$LOG/serving_tq.log" >> "$S"
  fi
  ;;
single)  # serving, then server, on one GPU (CLIENTS, TQ, BASE choose the server part)
  bash "$0" serving; bash "$0" server
  cat "$OUT"/summary_*.log
  ;;
hardening|hardening2)  # issue #39 on a machine of two GPUs: the 10-minute soak (--deterministic) on GPU 0, started
  # in the background by the first call, collected by the second; on GPU 1 server_load greedy (replies checked
  # against each prompt alone) and sampled, with and without --deterministic
  S="$OUT/summary_hardening.log"
  if [ "$1" = hardening ] && [ ! -e /tmp/soak_started ]; then
    touch /tmp/soak_started
    CUDA_VISIBLE_DEVICES=0 setsid bash -c "python -m benchmarks run soak --json /tmp/soak_gpu.json --model $CONFIG \
      --load-format dummy --device cuda --clients 64 --prompts 64 --max-tokens 64 --duration ${SOAK_S:-600} \
      --serve-args=--deterministic --server-log /tmp/soak_server.log > $LOG/soak.log 2>&1" < /dev/null > /dev/null 2>&1 &
  fi
  if [ "$1" = hardening ]; then runs="greedy greedy_det"; else runs="sampled_det sampled"; fi
  for run in $runs; do
    case $run in greedy*) temp=0;; *) temp=1;; esac
    case $run in *_det) extra=--serve-args=--deterministic;; *) extra=;; esac
    CUDA_VISIBLE_DEVICES=1 timeout 240 python -m benchmarks run server_load --json "$OUT/server_load_$run.json" \
      --model $CONFIG --load-format dummy --device cuda --endpoint completions --clients 64 --prompts 64 \
      --max-tokens 64 --duration 30 --temperature $temp --max-batch 64 $extra \
      --server-log "$LOG/server_load_$run.server.log" > "$LOG/server_load_$run.log" 2>&1 \
      || tail -20 "$LOG/server_load_$run.log" >> "$S"
    grep -E '"(completion_tokens_per_s|ttft_p50_s|ttft_p99_s|errors|mismatches|requests)"' "$LOG/server_load_$run.log" \
      | tr -d '\n' | sed "s/^/$run: /" >> "$S"; echo >> "$S"
    grep -i "a step took\|Traceback\|Error" "$LOG/server_load_$run.server.log" | head -5 >> "$S"
  done
  if [ "$1" = hardening2 ]; then
    for _ in $(seq 100); do pgrep -f "benchmarks run soak" > /dev/null || break; sleep 5; done
    cp /tmp/soak_gpu.json "$OUT/" 2>/dev/null
    tail -40 $LOG/soak.log >> "$S"; grep -i "a step took\|Traceback" /tmp/soak_server.log | head -5 >> "$S"
  else
    tail -3 $LOG/soak.log >> "$S"
  fi
  cat "$S"
  ;;
prefix)  # issue #41 on a machine of two GPUs: the prefix cache's GPU tests, the agent trace with the cache (GPU 0)
  # and without (GPU 1) at once
  S="$OUT/summary_prefix.log"
  for only in cached plain; do
    gpu=$([ $only = cached ] && echo 0 || echo 1)
    (
      if [ $only = cached ] && [ "${PREFIX_TESTS:-1}" = 1 ]; then
        CUDA_VISIBLE_DEVICES=0 timeout 150 python -m pytest -q -rf -p no:cacheprovider tests/test_gpu_engine.py \
          -k prefix_cache > "$LOG/tests_prefix.log" 2>&1
      fi
      CUDA_VISIBLE_DEVICES=$gpu timeout ${TRACE_S:-420} python -m benchmarks run agent_trace \
        --json "$OUT/agent_trace_$only.json" --model $CONFIG --load-format dummy --only $only ${TRACE_ARGS:-} \
        > "$LOG/agent_trace_$only.log" 2>&1 || tail -30 "$LOG/agent_trace_$only.log" > "$LOG/agent_trace_$only.err"
    ) &
  done
  wait
  grep -E "^(FAILED|ERROR|E  )|passed|failed" "$LOG/tests_prefix.log" 2>/dev/null | head -20 > "$S"
  cat "$LOG"/agent_trace_*.err >> "$S" 2>/dev/null
  grep -hE "^(cached|plain)" "$LOG"/agent_trace_*.log >> "$S"
  cat "$S"
  ;;
paged)  # issue #41's paged KV and #42's GPU kernels on a machine of four GPUs, one lane a GPU:
  # 0: the GPU tests the paged cache touches, then engine_gpu (decode 1/16/64) of this tree;
  # 1: sluice serve over HTTP, 64 and 16 clients; 2: paged_kv (64 sequences of 128..32k tokens in a quarter of the
  # rows layout's KV), then the agent trace with the cache; 3: engine_gpu of the tree before (.base/src), then
  # DeepSeek's GPU tests with its kernels on, mla_gpu and Moonlight's bench
  S="$OUT/summary_paged.log"
  (
    CUDA_VISIBLE_DEVICES=0 timeout 300 python -m pytest -q -rf -p no:cacheprovider tests/test_gpu_engine.py \
      tests/test_attention_triton.py tests/test_kv_cache.py tests/test_rope_triton.py tests/test_paged_kv.py \
      ${PAGED_TESTS:-} > "$LOG/tests_paged.log" 2>&1
    CUDA_VISIBLE_DEVICES=0 timeout 200 python -m benchmarks run engine_gpu --json "$OUT/engine_paged.json" \
      --config $CONFIG --batches 1,16,64 --kinds dense > "$LOG/engine_paged.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=1 CLIENTS="64 16" TQ=0 OUT=/tmp/server_out bash "$0" server > /dev/null 2>&1
    cp /tmp/server_out/server_load_*.json "$OUT/" 2>/dev/null
    cp /tmp/server_out/summary_server.log "$LOG/" 2>/dev/null
    grep -h "a step took" /tmp/server_out/*.server.log 2>/dev/null | head -8 > "$LOG/steps_took.log"
  ) &
  (
    CUDA_VISIBLE_DEVICES=2 timeout 300 python -m benchmarks run paged_kv --json "$OUT/paged_kv.json" --model $CONFIG \
      --load-format dummy > "$LOG/paged_kv.log" 2>&1
    CUDA_VISIBLE_DEVICES=2 timeout 240 python -m benchmarks run agent_trace --json /tmp/agent_trace.json --model $CONFIG \
      --load-format dummy --only cached > "$LOG/agent_trace.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=3 PYTHONPATH=/tmp/site:.base/src SLUICE_BENCH_COMMIT=base timeout 200 python -m benchmarks \
      run engine_gpu --json /tmp/engine_base.json --config $CONFIG --batches 1,16,64 --kinds dense \
      > "$LOG/engine_base.log" 2>&1
    CUDA_VISIBLE_DEVICES=3 timeout 200 python -m pytest -q -rf -p no:cacheprovider \
      tests/test_mla_triton.py tests/test_group_route_triton.py tests/test_deepseek.py -k "gpu or triton or cuda" \
      > "$LOG/tests_mla.log" 2>&1
    CUDA_VISIBLE_DEVICES=3 timeout 100 python -m benchmarks run mla_gpu \
      --json "$OUT/mla_gpu.json" > "$LOG/mla_gpu.log" 2>&1
    for b in 1 64; do
      CUDA_VISIBLE_DEVICES=3 timeout 90 python -m sluice bench \
        -m benchmarks/configs/moonlight-16b-a3b.json --load-format dummy --batch $b --prompt-tokens 512 \
        --gen-tokens 64 --repeats 1 --json > "$LOG/moonlight_$b.json" 2> "$LOG/moonlight_$b.log"
    done
  ) &
  wait
  {
    echo "== tests (paged)"; grep -E "^(FAILED|ERROR)|passed|failed" "$LOG/tests_paged.log" | head -20
    echo "== tests (MLA)"; grep -E "^(FAILED|ERROR)|passed|failed" "$LOG/tests_mla.log" | head -20
    echo "== engine_gpu this tree"; grep -A12 "^KV " "$LOG/engine_paged.log" | head -14
    echo "== engine_gpu base"; grep -A12 "^KV " "$LOG/engine_base.log" | head -14
    echo "== server"; cat "$LOG/summary_server.log" 2>/dev/null; cat "$LOG/steps_took.log"
    echo "== paged_kv"; tail -3 "$LOG/paged_kv.log"
    echo "== agent trace"; grep -E "^cached" "$LOG/agent_trace.log"; tail -3 "$LOG/agent_trace.log"
    echo "== mla_gpu"; tail -25 "$LOG/mla_gpu.log"
    for b in 1 64; do echo "== moonlight b$b"; tail -4 "$LOG/moonlight_$b.log"; cat "$LOG/moonlight_$b.json" | head -c 600; echo; done
  } > "$S" 2>&1
  tar czf "$OUT/logs.tgz" -C "$LOG" . 2>/dev/null
  cat "$S"
  ;;
paged2)  # issue #41 again, four GPUs: 0: the GPU tests (verbose, so a run cut short still names each result);
  # 1: engine_gpu (decode 1/16/64, prefill) of this tree, then of the tree before (.base/src); 2: sluice serve over
  # HTTP (64, 16 clients; its slow steps), then TurboQuant decode; 3: memory_budget (80B under --gpu-memory 40GiB),
  # then Moonlight's decode step anatomy
  S="$OUT/summary_paged2.log"
  (
    CUDA_VISIBLE_DEVICES=0 timeout 420 python -m pytest -v --tb=short -p no:cacheprovider tests/test_gpu_engine.py \
      tests/test_paged_kv.py tests/test_attention_triton.py tests/test_attention_cuda.py tests/test_rope_triton.py \
      ${PAGED_TESTS:-} > "$LOG/tests_paged2.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=1 timeout 200 python -m benchmarks run engine_gpu --json "$OUT/engine_paged2.json" \
      --config $CONFIG --batches 1,16,64 --kinds dense > "$LOG/engine_paged2.log" 2>&1
    CUDA_VISIBLE_DEVICES=1 PYTHONPATH=/tmp/site:.base/src SLUICE_BENCH_COMMIT=base timeout 200 python -m benchmarks \
      run engine_gpu --json /tmp/engine_base2.json --config $CONFIG --batches 1,16,64 --kinds dense \
      > "$LOG/engine_base2.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=2 CLIENTS="64 16" TQ=0 OUT=/tmp/server_out2 bash "$0" server > /dev/null 2>&1
    cp /tmp/server_out2/server_load_*.json "$OUT/" 2>/dev/null
    cp /tmp/server_out2/summary_server.log "$LOG/summary_server2.log" 2>/dev/null
    grep -h "a step took" /tmp/server_out2/*.server.log 2>/dev/null | head -12 > "$LOG/steps_took2.log"
    CUDA_VISIBLE_DEVICES=2 timeout 120 python -m benchmarks run engine_gpu --json "$OUT/engine_tq.json" \
      --config $CONFIG --batches 1,16 --kinds turboquant4 > "$LOG/engine_tq.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=3 timeout 300 python -m benchmarks run memory_budget --json "$OUT/memory_budget.json" \
      --model $CONFIG --load-format dummy --gpu-memory 40GiB > "$LOG/memory_budget.log" 2>&1
    CUDA_VISIBLE_DEVICES=3 timeout 200 python -m benchmarks run engine_gpu --json "$OUT/engine_moonlight.json" \
      --config benchmarks/configs/moonlight-16b-a3b.json --batches 1,64 --kinds dense > "$LOG/engine_moonlight.log" 2>&1
  ) &
  wait
  {
    echo "== tests"; grep -E "(PASSED|FAILED|ERROR|SKIPPED)" "$LOG/tests_paged2.log" | grep -vE "PASSED|SKIPPED" | head -30
    grep -cE " PASSED" "$LOG/tests_paged2.log"; tail -2 "$LOG/tests_paged2.log"
    echo "== engine_gpu this tree"; grep -A12 "^KV " "$LOG/engine_paged2.log" | head -14
    echo "== engine_gpu base"; grep -A12 "^KV " "$LOG/engine_base2.log" | head -14
    echo "== server"; cat "$LOG/summary_server2.log" 2>/dev/null; cat "$LOG/steps_took2.log"
    echo "== TurboQuant"; grep -A12 "^KV " "$LOG/engine_tq.log" | head -14; tail -3 "$LOG/engine_tq.log"
    echo "== memory_budget"; tail -12 "$LOG/memory_budget.log"
    echo "== moonlight"; grep -A14 "^KV " "$LOG/engine_moonlight.log" | head -30; tail -3 "$LOG/engine_moonlight.log"
  } > "$S" 2>&1
  tar czf "$OUT/logs.tgz" -C "$LOG" . 2>/dev/null
  cat "$S"
  ;;
paged3)  # what session 4 left unmeasured, four GPUs: 0: the GPU tests (two halves, verbose); 1: sluice serve over
  # HTTP, 64 clients (the first wave's slow step now logs its host time by phase), then paged_kv with preemptions
  # (long replies in a tenth of the rows layout's KV); 2: memory_budget (the profiled reserve under --gpu-memory
  # 40GiB), then the agent trace with the cache; 3: Moonlight's engine_gpu (batch 64 hit the graph-pool assert)
  S="$OUT/summary_paged3.log"
  (
    CUDA_VISIBLE_DEVICES=0 timeout 280 python -m pytest -v --tb=short -p no:cacheprovider tests/test_gpu_engine.py \
      tests/test_paged_kv.py tests/test_turboquant_paged.py tests/test_attention_cuda.py tests/test_kv_cache.py \
      -k "not demo_model" > "$LOG/tests_a.log" 2>&1
    CUDA_VISIBLE_DEVICES=0 timeout 280 python -m pytest -v --tb=short -p no:cacheprovider tests/test_attention_triton.py \
      tests/test_rope_triton.py tests/test_mla_triton.py tests/test_group_route_triton.py tests/test_deepseek.py \
      -k "gpu or triton or cuda or mla or route" > "$LOG/tests_b.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=1 CLIENTS=64 TQ=0 OUT=/tmp/server_out3 bash "$0" server > /dev/null 2>&1
    cp /tmp/server_out3/server_load_64.json "$OUT/" 2>/dev/null
    grep -h "a step took" /tmp/server_out3/*.server.log 2>/dev/null | head -12 > "$LOG/steps_took3.log"
    grep -h "HTTP" /tmp/server_out3/summary_server.log > "$LOG/summary_server3.log" 2>/dev/null
    CUDA_VISIBLE_DEVICES=1 timeout 300 python -m benchmarks run paged_kv --json "$OUT/paged_kv_preempt.json" \
      --model $CONFIG --load-format dummy --lengths 1024,16384 --max-tokens 1024 --blocks-share 0.1 \
      > "$LOG/paged_kv.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=2 timeout 300 python -m benchmarks run memory_budget --json "$OUT/memory_budget.json" \
      --model $CONFIG --load-format dummy --gpu-memory 40GiB > "$LOG/memory_budget.log" 2>&1
    CUDA_VISIBLE_DEVICES=2 timeout 240 python -m benchmarks run agent_trace --json "$OUT/agent_trace.json" \
      --model $CONFIG --load-format dummy --only cached > "$LOG/agent_trace.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=3 timeout 300 python -m benchmarks run engine_gpu --json "$OUT/engine_moonlight.json" \
      --config benchmarks/configs/moonlight-16b-a3b.json --batches 1,16,64 --kinds dense \
      > "$LOG/engine_moonlight.log" 2>&1
  ) &
  wait
  {
    echo "== tests"; cat "$LOG"/tests_[ab].log | grep -E "FAILED|ERROR" | head -30
    cat "$LOG"/tests_[ab].log | grep -cE " PASSED"; tail -1 "$LOG/tests_a.log"; tail -1 "$LOG/tests_b.log"
    echo "== server"; cat "$LOG/summary_server3.log" "$LOG/steps_took3.log" 2>/dev/null
    echo "== paged_kv (preemptions)"; tail -2 "$LOG/paged_kv.log"
    echo "== memory_budget"; tail -10 "$LOG/memory_budget.log"
    echo "== agent trace"; grep -E "^cached" "$LOG/agent_trace.log"
    echo "== moonlight"; grep -A14 "^KV " "$LOG/engine_moonlight.log" | head -24; tail -3 "$LOG/engine_moonlight.log"
  } > "$S" 2>&1
  tar czf "$OUT/logs.tgz" -C "$LOG" . 2>/dev/null
  cat "$S"
  ;;
backends)  # the attention backends refactor and what the profile of a slow step says, four GPUs: 0: the GPU tests;
  # 1: sluice serve over HTTP, 64 clients, every step profiled (a slow one logs its cProfile), then engine_gpu;
  # 2: the MLA decode sweep (heads 16 and 128), mla_gpu at the new defaults, Moonlight's engine_gpu; 3: the agent trace
  # at decode_prefill_chunk 512 and 2048, profiled
  S="$OUT/summary_backends.log"
  (
    CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=4 timeout 330 python -m pytest -q --tb=short -p no:cacheprovider \
      tests/test_gpu_engine.py tests/test_gpu_models.py tests/test_paged_kv.py tests/test_turboquant_paged.py \
      tests/test_attention_cuda.py tests/test_kv_cache.py tests/test_attention_triton.py tests/test_mla_triton.py \
      tests/test_deepseek.py -k "not demo_model and (gpu or cuda or triton or kernel or paged or graph or flat)" \
      > "$LOG/tests.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=1 SLUICE_PROFILE_SLOW=1 CLIENTS=64 TQ=0 OUT=/tmp/server_out4 bash "$0" server > /dev/null 2>&1
    cp /tmp/server_out4/server_load_64.json "$OUT/" 2>/dev/null
    cp /tmp/server_out4/server_load_64.server.log "$LOG/" 2>/dev/null
    grep -h "HTTP" /tmp/server_out4/summary_server.log > "$LOG/summary_server4.log" 2>/dev/null
    CUDA_VISIBLE_DEVICES=1 timeout 150 python -m benchmarks run engine_gpu --json "$OUT/engine_dense.json" \
      --config $CONFIG --batches 1,16,64 --kinds dense,turboquant4 > "$LOG/engine_dense.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=2 timeout 260 python -m benchmarks run mla_gpu --sweep --json "$OUT/mla_sweep.json" \
      > "$LOG/mla_sweep.log" 2>&1
    CUDA_VISIBLE_DEVICES=2 timeout 100 python -m benchmarks run mla_gpu --json "$OUT/mla_gpu.json" > "$LOG/mla_gpu.log" 2>&1
    CUDA_VISIBLE_DEVICES=2 timeout 150 python -m benchmarks run engine_gpu --json "$OUT/engine_moonlight.json" \
      --config benchmarks/configs/moonlight-16b-a3b.json --batches 1,64 --kinds dense > "$LOG/engine_moonlight.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=3 SLUICE_PROFILE_SLOW=1 timeout 400 python -m benchmarks run agent_trace \
      --json "$OUT/agent_trace.json" --model $CONFIG --load-format dummy --only cached --decode-prefill-chunk 512 2048 \
      > "$LOG/agent_trace.log" 2>&1
  ) &
  wait
  {
    echo "== tests"; grep -E "FAILED|ERROR|passed|failed" "$LOG/tests.log" | tail -25
    echo "== server"; cat "$LOG/summary_server4.log" 2>/dev/null
    grep -h "a step took" "$LOG/server_load_64.server.log" 2>/dev/null | head -6
    echo "== engine"; grep -A8 "^KV " "$LOG/engine_dense.log"
    echo "== mla sweep"; tail -40 "$LOG/mla_sweep.log"; echo "== mla_gpu"; tail -14 "$LOG/mla_gpu.log"
    echo "== moonlight"; grep -A4 "^KV " "$LOG/engine_moonlight.log"; tail -2 "$LOG/engine_moonlight.log"
    echo "== agent trace"; grep -E "^cached" "$LOG/agent_trace.log"; grep -c "its profile" "$LOG/agent_trace.log"
  } > "$S" 2>&1
  tar czf "$OUT/logs.tgz" -C "$LOG" . 2>/dev/null
  cat "$S"
  ;;
final)  # after the backends run: the GPU tests (pytest-timeout, verbose), HTTP 64 clients with the stall's cause
  # fixed, the agent trace profiled (what compiles mid-run), mla_gpu at the swept defaults, Moonlight
  S="$OUT/summary_final.log"
  T="timeout 330 python -m pytest -v --timeout 150 --tb=short -p no:cacheprovider"
  (
    CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=4 $T tests/test_gpu_engine.py tests/test_gpu_models.py \
      "tests/test_kv_cache.py::test_turboquant_prefill_on_the_gpu_matches_its_definition" \
      tests/test_kv_cache.py::test_flat_step_attention_matches_each_sequence_alone \
      tests/test_turboquant_paged.py::test_paged_cache_gives_the_outputs_of_rows -k "not demo_model" \
      > "$LOG/tests_a.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=1 CLIENTS=64 TQ=0 OUT=/tmp/server_out5 bash "$0" server > /dev/null 2>&1
    cp /tmp/server_out5/server_load_64.json "$OUT/" 2>/dev/null
    cp /tmp/server_out5/server_load_64.server.log "$LOG/" 2>/dev/null
    grep -h "HTTP" /tmp/server_out5/summary_server.log > "$LOG/summary_server5.log" 2>/dev/null
  ) &
  (
    CUDA_VISIBLE_DEVICES=2 SLUICE_PROFILE_SLOW=1 timeout 400 python -m benchmarks run agent_trace \
      --json "$OUT/agent_trace.json" --model $CONFIG --load-format dummy --only cached --decode-prefill-chunk 512 2048 \
      > "$LOG/agent_trace.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=3 OMP_NUM_THREADS=4 $T tests/test_attention_triton.py tests/test_attention_cuda.py \
      tests/test_mla_triton.py tests/test_deepseek.py::test_on_a_gpu > "$LOG/tests_b.log" 2>&1
    CUDA_VISIBLE_DEVICES=3 timeout 100 python -m benchmarks run mla_gpu --json "$OUT/mla_gpu.json" > "$LOG/mla_gpu.log" 2>&1
    CUDA_VISIBLE_DEVICES=3 timeout 150 python -m benchmarks run engine_gpu --json "$OUT/engine_moonlight.json" \
      --config benchmarks/configs/moonlight-16b-a3b.json --batches 1,16,64 --kinds dense > "$LOG/engine_moonlight.log" 2>&1
  ) &
  wait
  {
    echo "== tests"; grep -hE "FAILED|ERROR|Timeout|passed|failed" "$LOG"/tests_[ab].log | tail -25
    echo "== server"; cat "$LOG/summary_server5.log" 2>/dev/null
    grep -h "a step took" "$LOG/server_load_64.server.log" 2>/dev/null | head -6
    echo "== agent trace"; grep -E "^cached|a step took" "$LOG/agent_trace.log"
    echo "== mla_gpu"; grep -B1 -A13 "^shape" "$LOG/mla_gpu.log"
    echo "== moonlight"; grep -A4 "^KV " "$LOG/engine_moonlight.log"; tail -2 "$LOG/engine_moonlight.log"
  } > "$S" 2>&1
  tar czf "$OUT/logs.tgz" -C "$LOG" . 2>/dev/null
  cat "$S"
  ;;
both)  # serving and server at once, one GPU each (a machine of two GPUs)
  CUDA_VISIBLE_DEVICES=0 bash "$0" serving & CUDA_VISIBLE_DEVICES=1 bash "$0" server; wait
  cat "$OUT"/summary_*.log
  ;;
*)
  echo "usage: bash benchmarks/gpu_run.sh tests|bench|join|serving|server|single|both|hardening|hardening2|prefix|paged|paged2|paged3|backends|final" >&2
  exit 2
  ;;
esac
