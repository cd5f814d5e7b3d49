#!/usr/bin/env bash
# The GPU checks and benchmarks, for one call on the GPU machine; each result goes to $OUT/<part>.txt.
#   scripts/gpu_check.sh [tests] [tests_engine] [throughput] [hf] [8b] [host_tier] [trainer] [tp] [tp_tests] [async] [async64]
#                        [async17b] [prefill] [graphs] [staleness] [kv_reuse] [learn] [shared] [pause] [sync8b]
#                        [sync06b] [buckets] [moe_tests] [moe] [small] [small_ab] [handover] [tier_sweep] [pd_transfer]
#                        [handover2] [async1gpu] [workload_profile] [async_switch] [attn_tiles] [jit] [disagg]
#                        [pd_transfer_ab] (with OLD=DIR) [engine_ab] (with OLD=DIR) [pd_doorbells] [fresh] [floor]
#                        [async_spy] [balance] (OLD=DIR optional) [blocks8] [async1gpu_colocated]
#                        [fsdp_gather] [routing_return] [tests_rest] [tests_two] [residual_ab]
#                        [split_ab] [split_ab2] (both with OLD=DIR) [vector_ab]
# (no argument: tests tests_engine throughput host_tier; tp, tp_tests, async* (but async1gpu and async_spy), prefill, graphs,
# staleness, kv_reuse, learn, sync*, buckets, fsdp_gather and tests_two need two GPUs).
# tests, tests_engine, async*, prefill, staleness, learn, shared and sync8b need fastapi, uvicorn and aiohttp, which the GPU
# machine lacks: download their wheels into .whl/ (git-ignored) with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl fastapi starlette pydantic \
#       pydantic_core uvicorn typing-inspection annotated-types opentelemetry-api aiohttp aiohappyeyeballs \
#       aiosignal attrs frozenlist multidict propcache yarl idna
# (async_spy also needs py-spy's wheel there: the same download with --platform manylinux1_x86_64 py-spy)
# carry .whl, and start the command with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # (carried wheels may be on it already)
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
parts=${*:-tests tests_engine throughput host_tier}
python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count(), "x", torch.cuda.get_device_name())' \
    | tee "$OUT/device.txt"
for part in $parts; do
    echo "=== $part" | tee -a "$OUT/summary.txt"
    case $part in
        tests) timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py \
                   tests/test_prefill_kernel.py tests/test_fused_kernels.py tests/test_moe_kernels.py \
                   tests/test_fused_model.py tests/test_sampler.py -rs -s &&
               timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_training_kernels.py -rs ;;
        tests_engine) timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_gpu.py \
                   tests/test_host_tier.py tests/test_placement.py tests/test_transport.py tests/test_transport_dist.py \
                   tests/test_holds.py tests/test_trainer_parallel.py tests/test_step_order.py \
                   tests/test_routing_capture.py -rs -s ;;  # (the kernels' tests: `tests`; a call each, they take minutes)
        tests_rest) timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flight_recorder.py \
                       tests/test_host_tier_direct.py tests/test_page_move.py tests/test_sampler.py -rs ;;
        tests_two) timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_disagg_p2p.py -rs ;;  # (two GPUs)
        throughput) timeout 240 python3 benchmarks/engine_throughput.py --models qwen3-0.6b ;;
        moe_tests) timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_moe_kernels.py -rs ;;
        moe) timeout 560 python3 benchmarks/moe_throughput.py --routing-ab --profile-workload --out "$OUT/moe.json" ;;
        attn_ab) timeout 200 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/test_kernels.py;
                 for pps in 4 32; do timeout 200 python3 benchmarks/engine_throughput.py --models qwen3-0.6b \
                     --attention-programs-per-sm $pps; done ;;
        attn_tiles) timeout 200 python3 benchmarks/decode_attention_bench.py --mixed 100 2048 --table-tokens 40960 \
                     --batch 16 64 256 --page-size 16 --tiles ;;
        jit) timeout 200 python3 benchmarks/jit_variants.py --out "$OUT/jit.json";
             timeout 300 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/test_jit_variants.py \
                 tests/test_engine_gpu.py tests/test_prefill_kernel.py tests/test_sampler.py ;;
        disagg) timeout 400 python3 benchmarks/disaggregation.py --model qwen3-0.6b --out "$OUT/disagg.json" ;;
        workload_profile) timeout 300 python3 benchmarks/engine_throughput.py --models qwen3-0.6b \
                   --batches 1 4 8 16 32 64 128 --profile-workload ;;  # (with where the GPU sat idle)
        async_switch) timeout 300 python3 benchmarks/async_speedup.py engine_timeout_s=120 weight_sync_timeout_s=60 \
                   --model qwen3-0.6b --placement colocated --steps 8 --warmup 2 --staleness 2 \
                   --pause-modes in_place --switch-interval-ms 0.5 --out "$OUT/async_switch.json" ;;
        hf) timeout 420 python3 benchmarks/engine_throughput.py --models qwen3-0.6b --hf ;;
        8b) timeout 300 python3 benchmarks/engine_throughput.py --models qwen3-8b ;;
        host_tier) timeout 300 python3 benchmarks/host_tier.py --model qwen3-0.6b --concurrency 64 --episodes 192 ;;
        tp) TANDEM_TP_BACKEND=nccl timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_tp.py \
                -k "(generates or never_diverge or names_the_diverging or graphs) and not 3" -rs &&
            timeout 240 python3 benchmarks/tp_overhead.py --device cuda --model qwen3-0.6b --batch 64 --steps 200 ;;
        tp_tests) TANDEM_TP_BACKEND=nccl timeout 450 python3 -m pytest -q -p no:cacheprovider tests/test_tp.py \
                -k "(generates or never_diverge or names_the_diverging or graphs) and not 3" -rs ;;
        trainer) timeout 150 python3 benchmarks/trainer_step.py --model qwen3-0.6b --profile &&
                 for o in trainer.compile=false "trainer.compile=false trainer.fused_kernels=true"; do
                     timeout 100 python3 benchmarks/trainer_step.py --model qwen3-0.6b $o; done ;;
        async) timeout 480 python3 benchmarks/async_speedup.py engine_timeout_s=120 weight_sync_timeout_s=60 \
                   --model qwen3-0.6b --placement separate --steps 10 --warmup 2 --staleness 2 \
                   --pause-modes retract in_place ;;
        async64) timeout 400 python3 benchmarks/async_speedup.py engine_timeout_s=120 weight_sync_timeout_s=60 \
                   rollout.batch_groups=16 rollout.num_in_flight=256 engine.max_running_requests=256 \
                   --model qwen3-0.6b --placement separate --steps 8 --warmup 2 --staleness 2 \
                   --pause-modes retract in_place ;;
        pause) timeout 120 python3 benchmarks/engine_pause.py --model qwen3-0.6b ;;
        sync8b) timeout 200 python3 benchmarks/weight_sync.py --model qwen3-8b --busy 64 &&
                timeout 120 python3 benchmarks/weight_sync.py --model qwen3-0.6b --busy 64 ;;
        buckets) for mib in 128 512 2048; do timeout 100 python3 benchmarks/weight_sync.py --model qwen3-0.6b --busy 64 \
                   weight_bucket_bytes=$((mib << 20)); done ;;
        prefill) timeout 240 python3 benchmarks/async_speedup.py engine_timeout_s=120 weight_sync_timeout_s=60 \
                   engine.max_prefill_tokens=8192 --model qwen3-0.6b --placement separate --steps 10 --warmup 2 \
                   --staleness 2 ;;
        graphs) for max in 0 4096; do timeout 200 python3 benchmarks/async_speedup.py engine_timeout_s=120 \
                   weight_sync_timeout_s=60 engine.prefill_graph_max_tokens=$max --model qwen3-0.6b \
                   --placement separate --steps 10 --warmup 2 --staleness 2 --pause-modes in_place; done ;;
        async17b) timeout 400 python3 benchmarks/async_speedup.py engine_timeout_s=120 weight_sync_timeout_s=60 \
                   --model qwen3-1.7b --placement separate --steps 10 --warmup 2 --staleness 2 \
                   --pause-modes in_place ;;
        staleness) timeout 480 python3 benchmarks/async_speedup.py engine_timeout_s=120 weight_sync_timeout_s=60 \
                   --model qwen3-0.6b --placement separate --steps 20 --warmup 2 --staleness 1 2 4 \
                   --pause-modes in_place ;;
        shared) timeout 300 python3 benchmarks/async_speedup.py engine_timeout_s=120 weight_sync_timeout_s=60 \
                   --model qwen3-0.6b --placement shared --steps 10 --warmup 2 --staleness 2 \
                   --pause-modes retract in_place ;;
        kv_reuse) timeout 400 python3 benchmarks/async_speedup.py engine_timeout_s=120 weight_sync_timeout_s=60 \
                   --model qwen3-0.6b --placement separate --steps 10 --warmup 2 --staleness 2 4 \
                   --pause-modes in_place --cache-max-ages 0 2 ;;
        sync06b) timeout 120 python3 benchmarks/weight_sync.py --model qwen3-0.6b --busy 64 ;;
        learn) timeout 150 python3 benchmarks/async_speedup.py engine_timeout_s=120 weight_sync_timeout_s=60 \
                   --model qwen3-0.6b --placement separate --task target_tokens --steps 16 --warmup 2 \
                   --staleness 2 --pause-modes in_place ;;
        small) timeout 240 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider \
                   tests/test_fused_kernels.py tests/test_kernels.py -k "small or reference_gpu";
               timeout 300 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/test_engine_gpu.py;
               timeout 200 python3 benchmarks/engine_throughput.py --models qwen3-0.6b --batches 1 2 4 8 16 64 \
                   --small-ab --profile-batch 1 --skip-workload ;;
        small_ab) timeout 150 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider \
                      tests/test_fused_kernels.py tests/test_fused_model.py tests/test_engine_gpu.py \
                      -k "small or model or at_a_time";
                  timeout 240 python3 benchmarks/small_linear_blocks.py --rows 1 2 4 --out "$OUT/blocks.json";
                  timeout 180 python3 benchmarks/engine_throughput.py --models qwen3-0.6b --batches 1 2 4 8 16 \
                      --small-ab --skip-workload --profile-batch 1 ;;
        fresh) timeout 150 python3 benchmarks/engine_throughput.py --models qwen3-0.6b --batches 1 2 4 16 \
                   --small-ab --skip-workload --profile-batch 1;
               timeout 220 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/test_kernels.py \
                   tests/test_fused_model.py tests/test_engine_gpu.py -k "fresh or reference_gpu or graph or model \
                   or at_a_time or small_batch_kernels" ;;
        floor) timeout 150 python3 benchmarks/kernel_floor.py ;;
        handover) timeout 120 python3 benchmarks/weight_sync.py --model qwen3-0.6b --placement colocated shared \
                   --busy 64 --reps 8 --out "$OUT/handover.json" &&
                  timeout 420 python3 benchmarks/async_speedup.py engine_timeout_s=120 weight_sync_timeout_s=60 \
                   --model qwen3-0.6b --placement colocated --steps 10 --warmup 2 --staleness 2 \
                   --pause-modes in_place --out "$OUT/async1gpu.json" ;;
        handover2) timeout 200 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/test_pending_sync.py \
                   tests/test_placement.py tests/test_transport_handover.py &&
                   timeout 150 python3 benchmarks/weight_sync.py --model qwen3-0.6b --placement colocated shared \
                   --busy 64 --reps 8 --out "$OUT/handover.json" rollout.pause_mode=in_place ;;
        async1gpu) timeout 560 python3 benchmarks/async_speedup.py engine_timeout_s=120 weight_sync_timeout_s=60 \
                   --model qwen3-0.6b --placement shared --steps 20 --warmup 2 --staleness 2 \
                   --pause-modes in_place --cache-max-ages 0 2 --out "$OUT/async1gpu.json" ;;  # (the default
                   # placement on one GPU; colocated: async1gpu_colocated. Age 2: no history prefilled again)
        async1gpu_colocated) timeout 420 python3 benchmarks/async_speedup.py engine_timeout_s=120 \
                   weight_sync_timeout_s=60 --model qwen3-0.6b --placement colocated --steps 24 --warmup 2 \
                   --staleness 2 --pause-modes in_place --out "$OUT/async1gpu_colocated.json" ;;
        async_spy) spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)  # every process's stacks, idle ones too
                   timeout 300 "$spy" record -r 100 -f raw --subprocesses --idle --threads -o /tmp/async_spy.txt -- \
                       python3 benchmarks/async_speedup.py engine_timeout_s=120 weight_sync_timeout_s=60 \
                       --model qwen3-0.6b --placement shared --steps 8 --warmup 2 --staleness 2 \
                       --pause-modes in_place --out "$OUT/async_spy.json";
                   gzip -c /tmp/async_spy.txt > "$OUT/async_spy.txt.gz" ;;  # (uncompressed it is too large to return)
        tier_sweep) timeout 590 python3 benchmarks/host_tier.py --sweep --points 0,1 --out "$OUT/sweep_a.json" ;;
        pd_transfer) timeout 200 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider \
                   tests/test_disagg_checksum.py tests/test_disagg_transfer.py tests/test_disagg_kv_copy.py \
                   tests/test_disagg.py tests/test_kv_sums.py tests/test_disagg_staging.py tests/test_disagg_mailbox.py \
                   tests/test_kv_pass_graph.py;
                     timeout 120 python3 benchmarks/disaggregation.py --model qwen3-0.6b --transfer-only \
                   --transfer-reps 10 --out "$OUT/disagg_transfer.json";
                     timeout 120 python3 benchmarks/disaggregation.py --model qwen3-0.6b --transfer-only \
                   --transfer-reps 10 --pass-graphs --out "$OUT/disagg_transfer_graphs.json" ;;
        pd_doorbells) timeout 300 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/test_doorbell.py \
                   tests/test_disagg_staging.py;
                     timeout 240 python3 benchmarks/disaggregation.py --model qwen3-0.6b --out "$OUT/disagg.json";
                     timeout 240 python3 benchmarks/disaggregation.py --model qwen3-0.6b --no-doorbells \
                   --out "$OUT/disagg_no_doorbells.json";
                     timeout 60 python3 benchmarks/cold_host_ops.py ;;
        balance) E="python3 benchmarks/engine_throughput.py --models qwen3-0.6b --skip-workload"  # the A/Bs of the
                 # balanced split (8-64 requests), rows a row at a time (1-2) and, with OLD=DIR (a tree before the
                 # stage rule), the stage rule (4-16); then the workload with and without the balance
                 timeout 100 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/test_kernels.py \
                     tests/test_fused_kernels.py;
                 timeout 60 $E --batches 1 2 4 8 16 32 64;
                 timeout 50 $E --batches 1 2 --small-rowwise 0;
                 timeout 50 $E --batches 8 16 32 64 --attention-balance 0;
                 if [ -n "$OLD" ]; then (cd "$OLD" && PYTHONPATH=$PWD timeout 50 $E --batches 4 8 16); fi;
                 for a in "" "--attention-balance 0"; do
                     timeout 90 python3 benchmarks/engine_throughput.py --models qwen3-0.6b --batches 1 $a; done ;;
        blocks8) timeout 330 python3 benchmarks/small_linear_blocks.py --rows 4 8 16 --out "$OUT/blocks8.json";
                 timeout 120 python3 benchmarks/engine_throughput.py --models qwen3-0.6b --batches 3 4 8 16 \
                     --skip-workload --small-tilings "$OUT/blocks8.json" ;;  # (the sweep's best in the step)
        engine_ab) for i in 1 2; do  # OLD: another tree, e.g. `git archive REV | tar -x -C ab_old` (not ignored)
                     for tree in "${OLD:?set OLD to the tree to compare}" .; do echo "--- run $i, tree $tree";
                         (cd "$tree" && PYTHONPATH=$PWD:$PYTHONPATH timeout 80 python3 \
                             benchmarks/engine_throughput.py --models qwen3-0.6b --batches 1 4 8 16 \
                             --skip-workload); done
                     done;
                   timeout 60 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/test_kernels.py;
                   timeout 80 python3 benchmarks/engine_throughput.py --models qwen3-0.6b --batches 8 16 64 \
                       --skip-workload --attention-programs-per-sm 8;  # (fewer programs above 4 requests: an A/B)
                   timeout 80 python3 benchmarks/engine_throughput.py --models qwen3-0.6b --batches 8 \
                       --skip-workload --profile-batch 8 ;;
        pd_transfer_ab) for i in 1 2; do  # OLD: another tree to compare, e.g. `git archive REV | tar -x -C ab_old`
                     for tree in "${OLD:?set OLD to the tree to compare}" .; do echo "--- run $i, tree $tree";
                         (cd "$tree" && PYTHONPATH=$PWD:$PYTHONPATH timeout 120 python3 \
                             benchmarks/disaggregation.py --model qwen3-0.6b --transfer-only --transfer-reps 10); done
                     done ;;
        residual_ab) timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fused_kernels.py \
                         tests/test_engine_gpu.py -k "small_linear or hugging_face_one_or_two" -rs;
                     for early in ${RUNS:-0 1 0 1}; do timeout 100 python3 benchmarks/engine_throughput.py \
                         --models qwen3-0.6b --batches 1 2 4 16 --skip-workload --small-early-residual $early; done ;;
        split_ab) timeout 150 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/test_kernels.py;
                  E="benchmarks/engine_throughput.py --models qwen3-0.6b"  # OLD: the tree before (`engine_ab`'s way)
                  steps() { for tree in "${OLD:?set OLD to the tree to compare}" .; do echo "--- $1, $tree";
                      (cd "$tree" && PYTHONPATH=$PWD:$PYTHONPATH timeout 100 python3 $E --batches 1 4 8 16 32 64 \
                          --skip-workload); done; }
                  steps "run 1"
                  for tree in "$OLD" .; do echo "--- the workload, $tree"; (cd "$tree" &&
                      PYTHONPATH=$PWD:$PYTHONPATH timeout 120 python3 $E --batches 1); done; steps "run 2" ;;
        split_ab2) E="benchmarks/engine_throughput.py --models qwen3-0.6b"; for tree in "${OLD:?}" .; do
                       echo "--- $tree"; (cd "$tree" && PYTHONPATH=$PWD:$PYTHONPATH timeout 100 python3 $E --batches 8 \
                           16 32 64 128 --skip-workload); done; echo "--- the workload"; timeout 120 python3 $E --batches 1 ;;
        vector_ab) E="benchmarks/engine_throughput.py --models qwen3-0.6b --skip-workload --batches 2 4 8 16"
                   for i in 1 2; do for rows in "" 4 8; do echo "--- run $i, vector tiles up to ${rows:-the default} rows"
                       timeout 100 python3 $E ${rows:+--small-vector-rows $rows --small-rowwise $rows}; done; done ;;
        routing_return) timeout 500 python3 benchmarks/moe_throughput.py --routing-return \
                            --out "$OUT/routing_return.json" ;;  # (the cost of returning routed experts: an A/B)
        fsdp_gather) timeout 300 python3 benchmarks/fsdp_gather.py --model qwen3-0.6b --ranks 2 ;;  # (two GPUs)
        *) echo "unknown part $part" ;;
    esac 2>&1 | tee "$OUT/$part.txt"
    echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/summary.txt"
done
