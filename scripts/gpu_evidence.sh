#!/usr/bin/env bash
# Collect the project's GPU evidence in one go on a GPU host (no package index needed).
#
#   bash scripts/gpu_evidence.sh OUTDIR STAGE[:SECONDS] ...
#
# Each stage runs under its own time limit (and all of them within $DEADLINE
# seconds, default 560), logs to logs/<stage>.log and prints its last lines; a
# failing stage does not stop the next. After every stage OUTDIR/evidence.tar.gz
# is rewritten with data/measured/incoming/*.csv, profiles/ and logs/, ready to
# unpack into a checkout (`tar -xzf evidence.tar.gz`) and commit.
# Run it inside the offline bundle when CuTe DSL kernels are involved:
#   bash .bundle/run.sh bash scripts/gpu_evidence.sh "$OUT" env tests sweep-tp8 ...
# Set KIMI_DECODE_GIT_COMMIT where the tree travels without .git. Stages that time the options of runs 17-41
# (moe_pipe.HISTORY_VARIANTS), run 69's merge-tail2048 / -tail3584 / -tail2048-l2h (moe-merge, moe-l2h; moe_pipe.MERGE_HISTORY_VARIANTS),
# ring-rate, mma-rate and moe-tune (the direct kernels' launch shapes but TUNE_UP_BUILT / TUNE_DOWN_BUILT) need a bundle
# built with `kimi-decode bundle --tuning`.
set -u
OUT=${1:?usage: gpu_evidence.sh OUTDIR STAGE[:SECONDS]...}; shift
LOGS=${LOGS:-/tmp/kimi_decode_logs}
mkdir -p "$OUT" "$LOGS" data/measured/incoming profiles
END=$(( $(date +%s) + ${DEADLINE:-560} ))
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
KD="$PY -m kimi_decode.cli"
M=data/measured/incoming
# File names carry the card that made them (h200, h100, ...): timings from different cards are never mixed.
GT=${GPU_TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 | grep -oiE 'h[0-9]{3}|a100|b200|l40s?' | head -n1 | tr 'A-Z' 'a-z')}
GT=${GT:-gpu}

stage_cmd() {
  case "$1" in
    env) echo "nvidia-smi; ncu --version; readlink -f \$(which ncu); ls -d /opt/nvidia/nsight-compute/*/extras/python /usr/local/cuda*/nsight-compute*/extras/python 2>/dev/null; $PY -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'" ;;
    tests) echo "$PY -m pytest -q -p no:cacheprovider tests/test_stock_schedule.py tests/test_bench_graph.py tests/test_sweeps.py tests/test_stock_triton_small.py tests/test_stock_triton_kda.py tests/test_stock_triton_mla.py tests/test_stock_triton_moe.py tests/test_compile_peer.py" ;;
    bench-graph-test) echo "$PY -m pytest -q -p no:cacheprovider tests/test_bench_graph.py" ;;
    sweep-tp8) echo "$KD sweep --executor stock --tps 8 --no-progress --out $M/stock_${GT}_tp8.csv" ;;
    sweep-tp16) echo "$KD sweep --executor stock --tps 16 --no-progress --out $M/stock_${GT}_tp16.csv" ;;
    check-verify) echo "$KD sweep --executor stock --check-only --tps 8 --layers kda_moe,mla_moe --batches 1,8,64 --contexts 8192 --tokens 4,8 --no-progress --out $M/stock_${GT}_check_verify.csv" ;;
    compile-tp8) echo "$KD sweep --executor compile --tps 8 --no-progress --out $M/compile_${GT}_tp8.csv" ;;
    compile-tp16) echo "$KD sweep --executor compile --tps 16 --no-progress --out $M/compile_${GT}_tp16.csv" ;;
    fused-tests) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py tests/test_kernels_gemv.py" ;;
    moe-bench) echo "$KD moe --executors stock,fused,fused@cand0,fused@run35,fused-pdl,fused-nopdl,fused-direct,fused-pipeup,fused5 --tps 8 --batches 1,8,64 --no-progress --out $M/moe_half_${GT}_tp8.csv" ;;
    moe-tune) echo "$KD moe --executors fused-direct,fused-direct@w4r1-w4r4e4s4,fused-direct@w8r1-w4r4e4s4,fused-direct@w8r2-w4r4e4s4,fused-direct@w4r2-w4r4e2s8,fused-direct@w4r2-w4r8e4s4,fused-direct@w4r2-w4r8e2s8,fused-direct@w4r2-w8r4e4s4,fused-direct@w4r2-w4r16e2s4 --tps 8 --batches 1,8 --no-progress --out $M/moe_tuning_${GT}_tp8.csv" ;;
    moe-trace) echo "$KD moe --trace --executors fused --tps 8 --batches 1,8 --no-progress --out $M/moe_trace_${GT}_tp8.csv.xz" ;;
    moe-ablation) echo "$KD moe --executors stock,fused,fused@run17,fused@pro0,fused@epi0,fused@prod0,fused@swap0 --tps 8 --batches 1,2,8 --no-progress --out $M/moe_ablation_${GT}_tp8.csv" ;;
    moe-early) echo "$KD moe --executors stock,fused,fused@downearly0 --tps 8 --batches 1,2,8 --no-progress --out $M/moe_early_${GT}_tp8.csv && $KD moe --trace --executors fused@downearly0 --tps 8 --batches 1 --no-progress --out $M/moe_trace_downearly0_${GT}_tp8.csv.xz" ;;
    moe-items) echo "$KD moe --executors stock,fused,fused@late0,fused@upw28,fused@dec2,fused@pad,fused@downk2,fused@upw28-dec2-downk2,fused@upw28-dec2-pad-downk2 --tps 8 --batches 1,2,8 --no-progress --out $M/moe_items_${GT}_tp8.csv && $KD moe --trace --executors fused@upw28-dec2-pad-downk2 --tps 8 --batches 1 --no-progress --out $M/moe_trace_items_${GT}_tp8.csv.xz" ;;
    moe-breakdown-items) echo "$KD moe --breakdown --executors fused,fused@upw28-dec2-pad-downk2 --tps 8 --batches 1,8 --no-progress --out $M/moe_breakdown_items_${GT}_tp8.csv" ;;
    fused-variant-tests) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'variants_match'" ;;
    moe-warps) echo "$KD moe --executors stock,fused,fused@upw16,fused@run24 --tps 8 --batches 1,2,8 --no-progress --out $M/moe_warps_${GT}_tp8.csv" ;;
    moe-bal) echo "$KD moe --executors stock,fused,fused@bal --tps 8 --batches 1,2,8 --no-progress --out $M/moe_bal_${GT}_tp8.csv" ;;
    moe-breakdown-bal) echo "$KD moe --breakdown --executors fused,fused@bal --tps 8 --batches 1,8 --no-progress --out $M/moe_breakdown_bal_${GT}_tp8.csv" ;;
    trace-tests) echo "$PY -m pytest -q -p no:cacheprovider tests/test_moe_trace.py" ;;
    moe-breakdown-run24) echo "$KD moe --breakdown --executors fused,fused@run24 --tps 8 --batches 1,8 --no-progress --out $M/moe_breakdown_run24_${GT}_tp8.csv" ;;
    moe-trace-run24) echo "$KD moe --trace --executors fused@run24 --tps 8 --batches 1,8 --no-progress --out $M/moe_trace_run24_${GT}_tp8.csv.xz" ;;
    moe-breakdown-run35) echo "$KD moe --breakdown --executors fused,fused@run35 --tps 8 --batches 1,8 --no-progress --out $M/moe_breakdown_run35_${GT}_tp8.csv" ;;
    moe-breakdown-run27) echo "$KD moe --breakdown --executors fused,fused@run27 --tps 8 --batches 1,8 --no-progress --out $M/moe_breakdown_run27_${GT}_tp8.csv" ;;
    moe-breakdown-run20) echo "$KD moe --breakdown --executors fused,fused@run20 --tps 8 --batches 1,8 --no-progress --out $M/moe_breakdown_run20_${GT}_tp8.csv" ;;
    moe-breakdown-run17) echo "$KD moe --breakdown --executors fused,fused@run17 --tps 8 --batches 1,8 --no-progress --out $M/moe_breakdown_run17_${GT}_tp8.csv" ;;
    moe-breakdown) echo "$KD moe --breakdown --executors stock,fused,fused-direct,fused5 --tps 8 --batches 1,8 --no-progress --out $M/moe_breakdown_${GT}_tp8.csv" ;;
    moe-bench5) echo "$KD moe --executors stock,fused,fused5 --tps 8 --batches 1,8,64 --no-progress --out $M/moe_half_${GT}_tp8_v3.csv" ;;
    profile-fused5) echo "$KD profile --executor fused5-moe --layer kda_moe --tp 8 --batch 1 && $KD profile --executor fused5-moe --layer kda_moe --tp 8 --batch 8" ;;
    moe-bench-tp16) echo "$KD moe --executors stock,fused --tps 16 --batches 1,8,64 --no-progress --out $M/moe_half_${GT}_tp16.csv" ;;
    moe-headline) echo "$KD moe --executors stock,fused --tps 8 --batches 1,8,64 --no-progress --out $M/moe_half_${GT}_tp8.csv" ;;
    moe-fring-geom) echo "$KD moe --executors stock,fused,fused@fring,fused@fring2x6,fused@fring2x7 --tps 8 --batches 1 --no-progress --out $M/moe_fring_geom_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@fring,fused@fring2x6,fused@fring2x7 --tps 8 --batches 1 --no-progress --out $M/moe_breakdown_fring_geom_${GT}_tp8.csv" ;;
    profile-fring-geom) echo "$KD profile --executor fused-moe@fring2x7 --layer kda_moe --tp 8 --batch 1 --metrics stalls --source 'front_ring'" ;;
    moe-cotail) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'cotail or occupancy_builds' && $KD moe --executors stock,fused,fused@cotail --tps 8 --batches 1 --no-progress --out $M/moe_cotail_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@cotail --tps 8 --batches 1 --no-progress --out $M/moe_breakdown_cotail_${GT}_tp8.csv" ;;
    moe-cotail2) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'tringco' && $KD moe --executors fused,fused@cotail,fused@tringco --tps 8 --batches 1 --no-progress --out $M/moe_cotail2_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@cotail,fused@tringco --tps 8 --batches 1 --no-progress --out $M/moe_breakdown_cotail2_${GT}_tp8.csv" ;;
    ring-tests) echo "$PY -m pytest -q -p no:cacheprovider tests/test_ring_rate.py && $PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'ring or cotail or tringco'" ;;
    ring-rate) echo "$KD ring-rate --no-progress --out $M/ring_rate_${GT}.csv" ;;
    profile-rings) echo "$KD profile --executor fused-moe@tring0 --layer kda_moe --tp 8 --batch 1 && $KD profile --executor fused-moe@tring --layer kda_moe --tp 8 --batch 1 && $KD profile --executor fused-moe@tringco --layer kda_moe --tp 8 --batch 1" ;;
    moe-ring2) echo "$KD moe --executors fused,fused@tring4x3c2,fused@tring2x7c2,fused@fring,fused@fring2x3c2 --tps 8 --batches 1 --no-progress --out $M/moe_ring2_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@tring4x3c2,fused@tring2x7c2,fused@fring,fused@fring2x3c2 --tps 8 --batches 1 --no-progress --out $M/moe_breakdown_ring2_${GT}_tp8.csv" ;;
    moe-ring8) echo "$KD moe --executors fused,fused@tring4x8 --tps 8 --batches 1 --no-progress --out $M/moe_ring8_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@tring4x8 --tps 8 --batches 1 --no-progress --out $M/moe_breakdown_ring8_${GT}_tp8.csv && $PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'tring4x8'" ;;
    moe-dflagt) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'dflag' && $KD moe --executors stock,fused,fused@dflag,fused@dflagt --tps 8 --batches 1,2,8 --no-progress --out $M/moe_dflagt_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@dflagt --tps 8 --batches 1 --no-progress --out $M/moe_breakdown_dflagt_${GT}_tp8.csv" ;;
    moe-sfirst) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'prologue_and_extra_warp or dflag or tail_ring_equals' && $KD moe --executors stock,fused,fused@sfirst --tps 8 --batches 1,2,8 --no-progress --out $M/moe_sfirst_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@sfirst --tps 8 --batches 1,8 --no-progress --out $M/moe_breakdown_sfirst_${GT}_tp8.csv && $KD moe --trace --executors fused@sfirst --tps 8 --batches 1 --no-progress --out $M/moe_trace_sfirst_${GT}_tp8.csv.xz && $KD moe --trace --executors fused --tps 8 --batches 1 --no-progress --out $M/moe_trace_sfirst_base_${GT}_tp8.csv.xz" ;;
    moe-uflag) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'uflag or fpdl' && $KD moe --executors stock,fused,fused@fpdl,fused@uflag1,fused@uflag3,fused@fpdl-uflag1 --tps 8 --batches 1,2,8 --no-progress --out $M/moe_uflag_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@fpdl-uflag1 --tps 8 --batches 1 --no-progress --out $M/moe_breakdown_uflag_${GT}_tp8.csv && $KD moe --trace --executors fused@uflag1 --tps 8 --batches 1 --no-progress --out $M/moe_trace_uflag1_${GT}_tp8.csv.xz && $KD moe --trace --executors fused --tps 8 --batches 1 --no-progress --out $M/moe_trace_uflag_base_${GT}_tp8.csv.xz" ;;
    moe-uflag-time) echo "$KD moe --executors stock,fused,fused@fpdl,fused@uflag1,fused@uflag3,fused@fpdl-uflag1,fused@fpdl-uflag3 --tps 8 --batches 1 --no-progress --out $M/moe_uflag2_${GT}_tp8.csv" ;;
    moe-merge) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'merge or merged' && $KD moe --executors stock,fused,fused@merge,fused@merge-downearly3,fused@merge-tail2048,fused@tail2048 --tps 8 --batches 1,2,8 --no-progress --out $M/moe_merge_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@merge --tps 8 --batches 1 --no-progress --out $M/moe_breakdown_merge_${GT}_tp8.csv" ;;
    moe-merge-trace) echo "$PY -m pytest -q -p no:cacheprovider tests/test_moe_trace.py -k 'traced_step' && $KD moe --trace --executors fused@merge --tps 8 --batches 1 --no-progress --out $M/moe_trace_merge_${GT}_tp8.csv.xz && $KD moe --trace --executors fused --tps 8 --batches 1 --no-progress --out $M/moe_trace_merge_base_${GT}_tp8.csv.xz" ;;
    moe-l2h) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'l2h' && $KD moe --executors stock,fused,fused@tail2048,fused@l2h,fused@tail2048-l2h,fused@tail3584-l2h,fused@merge,fused@merge-tail2048-l2h,fused@merge-tail3584-l2h --tps 8 --batches 1,2,8 --no-progress --out $M/moe_l2h_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@tail3584-l2h --tps 8 --batches 1 --no-progress --out $M/moe_breakdown_l2h_${GT}_tp8.csv" ;;
    moe-run69-b1) echo "$KD moe --executors stock,fused,fused@tail2048,fused@l2h,fused@tail2048-l2h,fused@tail3584-l2h,fused@merge,fused@merge-downearly3,fused@merge-tail3584-l2h --tps 8 --batches 1 --no-progress --out $M/moe_run69_b1_${GT}_tp8.csv" ;;  # the merged kernel last: rows are written as they come, so a hang in it would cost only its own rows (run 69 also timed merge-tail2048, -tail3584 and -tail2048-l2h: since 2026-12-07 built with bundle --tuning only)
    moe-shup) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'shup' && $KD moe --executors stock,fused,fused@shup --tps 8 --batches 1 --no-progress --out $M/moe_shup_b1_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@shup --tps 8 --batches 1 --no-progress --out $M/moe_breakdown_shup_${GT}_tp8.csv" ;;  # run 70 also timed shup-l2h and upmax2-shup (now built with bundle --tuning only)
    moe-trace-shupi) echo "$KD moe --trace --executors fused --tps 8 --batches 1 --no-progress --out $M/moe_trace_shupi_base_${GT}_tp8.csv.xz && $KD moe --trace --executors fused@shupi2 --tps 8 --batches 1 --no-progress --out $M/moe_trace_shupi2_${GT}_tp8.csv.xz" ;;  # --trace takes one executor (run 71)
    moe-shupi) echo "$KD moe --executors stock,fused,fused@shupi2,fused@shupi3,fused@shupi4,fused@shup,fused@shupi2-tail2048,fused@shupi2-tail2048-l2h,fused@shupi3-tail2048-l2h --tps 8 --batches 1 --no-progress --out $M/moe_shupi_b1_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@shupi2,fused@shupi4 --tps 8 --batches 1 --no-progress --out $M/moe_breakdown_shupi_${GT}_tp8.csv && $PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'shup' && $KD moe --executors stock,fused,fused@upmax2-shupi2 --tps 8 --batches 2 --no-progress --out $M/moe_shupi_b2_${GT}_tp8.csv" ;;  # timing first: the tests after it (shup and shupiN: the shup builds changed after run 70, d28f5b4)
    moe-shfront) echo "$KD moe --executors stock,fused,fused@shupi2,fused@shupi2-shfront512,fused@shupi2-shfront384,fused@shupi2-shfront256 --tps 8 --batches 1 --no-progress --out $M/moe_shfront_b1_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@shupi2,fused@shupi2-shfront384 --tps 8 --batches 1 --no-progress --out $M/moe_breakdown_shfront_${GT}_tp8.csv && $PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'shfront'" ;;  # the share of the shared gate/up rows moe_up streams: 768 (shupi2), 256, 384, 512 of 768 columns
    profile-shupi) echo "$KD profile --executor fused-moe@shupi2 --layer kda_moe --tp 8 --batch 1 --metrics stalls --source 'up_kernel'" ;;  # where moe_up's interleaved shared items spend their cycles (run 71's timeline: about 1 µs a shared item on the H100)
    moe-shfix) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'shup or shfront' && $KD moe --executors stock,fused,fused@shupi2,fused@shupi2-shfront512,fused@shupi2-shfront384,fused@shupi2-shfront256,fused@shupi3,fused@shup,fused --tps 8 --batches 1 --no-progress --out $M/moe_shfix_b1_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@shupi2,fused@shupi2-shfront384 --tps 8 --batches 1 --no-progress --out $M/moe_breakdown_shfix_${GT}_tp8.csv && $KD moe --trace --executors fused@shupi2 --tps 8 --batches 1 --no-progress --out $M/moe_trace_shfix_${GT}_tp8.csv.xz && $KD moe --executors stock,fused,fused@upmax2-shupi2 --tps 8 --batches 2 --no-progress --out $M/moe_shfix_b2_${GT}_tp8.csv" ;;  # the shup builds with their branch kept (0936e3e): tests first, then timing, breakdown, timeline
    moe-shcombo) echo "$KD moe --executors stock,fused,fused@shupi2,fused@shupi2-tail2048-l2h,fused@shupi3-tail2048-l2h,fused@tail2048-l2h,fused --tps 8 --batches 1 --no-progress --out $M/moe_shcombo_b1_${GT}_tp8.csv" ;;  # the shup fix with the tail's prefetch (both built by default), for the H200 where moe_down leaves bandwidth spare
    moe-mma) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'tensor_core or matches_reference_tp' && $KD moe --executors stock,fused,fused@mma0 --tps 8 --batches 5,8,17,64 --no-progress --out $M/moe_mma_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@mma0 --tps 8 --batches 8,64 --no-progress --out $M/moe_breakdown_mma_${GT}_tp8.csv" ;;  # the front and tail GEMVs on tensor cores from 5 tokens (the default) against the CUDA-core ones ('mma0'): tests first, then timing and the per-launch breakdown
    moe-trace-mma) echo "$KD moe --trace --executors fused --tps 8 --batches 8 --no-progress --out $M/moe_trace_mma_${GT}_tp8.csv.xz && $KD moe --trace --executors fused@mma0 --tps 8 --batches 8 --no-progress --out $M/moe_trace_mma0_${GT}_tp8.csv.xz" ;;  # run 74: the launch after the CUDA-core front took 12-17 us longer than after the tensor-core one; the timelines' %clock64 over %globaltimer give the SM clock of each
    moe-wide) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'wide or matches_reference_tp or same_experts or share_an_expert' && $KD moe --executors stock,fused,fused-direct --tps 8 --batches 9,17,64 --no-progress --out $M/moe_wide_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused-direct --tps 8 --batches 17,64 --no-progress --out $M/moe_breakdown_wide_${GT}_tp8.csv" ;;  # moe_down above 8 tokens as a ring whose slots bring the activations (kernels/moe_wide.py, the default) against the direct moe_down ('fused-direct'; its moe_up is the same direct kernel): tests first, then timing and the per-launch breakdown
    moe-wide-more) echo "$KD moe --executors stock,fused,fused-direct --tps 16 --batches 17,64 --no-progress --out $M/moe_wide_${GT}_tp16.csv && $KD moe --executors stock,fused,fused-direct --tps 8 --batches 64 --tokens 8 --no-progress --out $M/moe_wide_t8_${GT}_tp8.csv" ;;
    moe-wide-dec) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'wide or same_experts or (matches_reference_tp8 and (17 or 64))' && $KD moe --executors stock,fused,fused@wsync,fused@wst4,fused@wupst4,fused@wdownst4,fused@wdownc16 --tps 8 --batches 17,64 --no-progress --out $M/moe_wide_dec_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@wsync --tps 8 --batches 64 --no-progress --out $M/moe_breakdown_wide_dec_${GT}_tp8.csv && $KD moe --executors stock,fused,fused@wsync,fused@wdownc16 --tps 8 --batches 32,64 --tokens 8 --no-progress --out $M/moe_wide_dec_t8_${GT}_tp8.csv" ;;  # the wide kernels' decoupled hand-over (the default since 2026-12-07) against a CTA barrier per item ('wsync'), deeper rings, moe_down's 16-token items
    moe-wide-r256) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'wide_options or wide_expert_kernels_repeat' && $KD moe --executors stock,fused,fused@wsync,fused@wdownr256 --tps 8 --batches 17,64 --no-progress --out $M/moe_wide_r256_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@wdownr256 --tps 8 --batches 64 --no-progress --out $M/moe_breakdown_wide_r256_${GT}_tp8.csv && $KD moe --executors stock,fused,fused@wdownr256 --tps 8 --batches 64 --tokens 8 --no-progress --out $M/moe_wide_r256_t8_${GT}_tp8.csv" ;;  # moe_down's 256-row items (one warp per 16 rows with all of K: no meeting) against the default, and the decoupled default against wsync on this card
    moe-wide-r256-short) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'wide_options and wdownr256' && $KD moe --executors stock,fused,fused@wdownr256 --tps 8 --batches 64 --no-progress --out $M/moe_wide_r256_${GT}_tp8.csv" ;;  # moe-wide-r256 cut to fit a call of about 2 minutes
    moe-rspread) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'spread_routing or routing_in_front or candidate_routing_equals or ties_go' && $KD moe --executors stock,fused,fused@rspread0 --tps 8 --batches 17,64 --no-progress --out $M/moe_rspread_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@rspread0 --tps 8 --batches 17,64 --no-progress --out $M/moe_breakdown_rspread_${GT}_tp8.csv && $KD moe --executors stock,fused,fused@rspread0 --tps 8 --batches 64 --tokens 8 --no-progress --out $M/moe_rspread_t8_${GT}_tp8.csv" ;;  # the routing launch over one CTA per 16 tokens (the default since 2026-12-07) against one CTA ('rspread0')
    moe-mma-tp16) echo "$KD moe --executors stock,fused,fused@mma0 --tps 16 --batches 8,64 --no-progress --out $M/moe_mma_${GT}_tp16.csv" ;;
    gemv-mma) echo "$PY -m pytest -q -p no:cacheprovider tests/test_kernels_gemv.py -k 'mma' && $PY scripts/bench_kernels.py --only gemv --m 1 8 64 --replays 50 --out /tmp/kd_gemv_mma && cp /tmp/kd_gemv_mma/kernels_gemv.csv $M/kernels_gemv_mma_${GT}.csv" ;;  # the tensor-core GEMV (GemvKey.mma) beside the CUDA-core one and torch.mm at 1, 8 and 64 tokens
    moe-run69-tiny) echo "$KD moe --executors fused,fused@tail3584-l2h,fused@merge,fused@tail2048-l2h,fused@merge-tail3584-l2h --tps 8 --batches 1 --no-progress --out $M/moe_run69_tiny_${GT}_tp8.csv" ;;  # for a call of under 3 minutes
    moe-run69-tests) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'l2h or merged_expert_kernel or merged_steps_rearm or merged_expert_kernel_refuses'" ;;
    moe-merge-check) echo "$KD moe --check-only --executors fused@merge,fused@merge-downearly3 --tps 8 --batches 1,2,8 --tokens 1,4,8 --no-progress --out $M/moe_merge_${GT}_check_verify.csv" ;;
    fused-tests-rest) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py tests/test_kernels_gemv.py tests/test_moe_trace.py -k 'not prologue_and_extra_warp'" ;;
    moe-sfirst2) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'prologue_and_extra_warp and sfirst2' && $KD moe --executors stock,fused,fused@sfirst2 --tps 8 --batches 1,2,8 --no-progress --out $M/moe_sfirst2_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@sfirst2 --tps 8 --batches 1 --no-progress --out $M/moe_breakdown_sfirst2_${GT}_tp8.csv" ;;  # its timeline build retired after run 66 (TRACE_VARIANTS)
    moe-check-verify) echo "$KD moe --check-only --executors stock,fused --tps 8 --batches 1,2,8,17,64 --tokens 1,4,8 --no-progress --out $M/moe_half_${GT}_check_verify.csv" ;;
    profile-stalls) echo "$KD profile --executor fused-moe --layer kda_moe --tp 8 --batch 1 --metrics stalls --source 'up_kernel|down_kernel' && $KD profile --executor fused-moe --layer kda_moe --tp 8 --batch 8 --metrics stalls" ;;
    moe-spread) echo "$KD moe --executors stock,fused,fused@dec3,fused@zlast,fused@dec3-zlast --tps 8 --batches 1,2,8 --no-progress --out $M/moe_spread_${GT}_tp8.csv && $KD moe --trace --executors fused@dec3-zlast --tps 8 --batches 1,8 --no-progress --out $M/moe_trace_spread_${GT}_tp8.csv.xz" ;;
    moe-breakdown-spread) echo "$KD moe --breakdown --executors fused,fused@dec3-zlast --tps 8 --batches 1,8 --no-progress --out $M/moe_breakdown_spread_${GT}_tp8.csv" ;;
    fused-spread-tests) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'variants_match and (dec3 or zlast or None)'; $PY -m pytest -q -p no:cacheprovider tests/test_mma_rate.py" ;;
    moe-f16) echo "$KD moe --executors stock,fused,fused@f16,fused@pair,fused@f16-pair --tps 8 --batches 1,2,8 --no-progress --out $M/moe_f16_${GT}_tp8.csv && $KD moe --trace --executors fused@f16 --tps 8 --batches 1,8 --no-progress --out $M/moe_trace_f16_${GT}_tp8.csv.xz" ;;
    fused-opt-tests) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'variants_match and (f16 or pair or lazy or zswz or None)'" ;;
    moe-zswz) echo "$KD moe --executors stock,fused,fused@zswz,fused@f16,fused@zswz-pair --tps 8 --batches 1,2,8 --no-progress --out $M/moe_zswz_${GT}_tp8.csv && $KD moe --check-only --executors fused@zswz,fused@f16 --tps 8 --batches 1,2,8 --tokens 1,4,8 --no-progress --out $M/moe_zswz_${GT}_check_verify.csv && $KD moe --trace --executors fused@zswz --tps 8 --batches 1,8 --no-progress --out $M/moe_trace_zswz_${GT}_tp8.csv.xz" ;;
    moe-lazy) echo "$KD moe --executors stock,fused,fused@pair,fused@lazy,fused@pair-lazy --tps 8 --batches 1,2,8 --no-progress --out $M/moe_lazy_${GT}_tp8.csv && $KD moe --trace --executors fused@pair-lazy --tps 8 --batches 1,8 --no-progress --out $M/moe_trace_lazy_${GT}_tp8.csv.xz" ;;
    fused-fw-tests) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'variants_match and (fence0 or fwarp or None)'" ;;
    moe-fwarp) echo "$KD moe --executors stock,fused,fused@fence0,fused@fwarp,fused@fence0-fwarp --tps 8 --batches 1,2,8 --no-progress --out $M/moe_fwarp_${GT}_tp8.csv && $KD moe --check-only --executors fused@fence0,fused@fwarp,fused@fence0-fwarp --tps 8 --batches 1,2,8,17 --tokens 1,4,8 --no-progress --out $M/moe_fwarp_${GT}_check_verify.csv" ;;
    moe-trace-fwarp) echo "$KD moe --trace --executors fused@fwarp --tps 8 --batches 1,8 --no-progress --out $M/moe_trace_fwarp_${GT}_tp8.csv.xz" ;;
    moe-breakdown-fwarp) echo "$KD moe --breakdown --executors fused,fused@fence0-fwarp --tps 8 --batches 1,8 --no-progress --out $M/moe_breakdown_fwarp_${GT}_tp8.csv" ;;
    moe-spin) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'variants_match and (spin or None)' && $KD moe --executors stock,fused,fused@spin,fused@upspin --tps 8 --batches 1,2,8 --no-progress --out $M/moe_spin_${GT}_tp8.csv && $KD moe --check-only --executors fused@spin --tps 8 --batches 1,2,8,17 --tokens 1,4,8 --no-progress --out $M/moe_spin_${GT}_check_verify.csv && $KD moe --trace --executors fused@spin --tps 8 --batches 1,8 --no-progress --out $M/moe_trace_spin_${GT}_tp8.csv.xz" ;;
    moe-upst5) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'variants_match and (upst5 or None)' && $KD moe --executors stock,fused,fused@upst5-upmax4 --tps 8 --batches 1,2,4 --no-progress --out $M/moe_upst5_${GT}_tp8.csv && $KD moe --check-only --executors fused@upst5-upmax4 --tps 8 --batches 1,2,4 --tokens 1 --no-progress --out $M/moe_upst5_${GT}_check_verify.csv && $KD moe --trace --executors fused@upst5-upmax4 --tps 8 --batches 1,2 --no-progress --out $M/moe_trace_upst5_${GT}_tp8.csv.xz" ;;
    moe-focc) echo "$KD moe --executors stock,fused,fused@focc12,fused@focc8 --tps 8 --batches 1,2,8 --no-progress --out $M/moe_focc_${GT}_tp8.csv && $KD moe --check-only --executors fused@focc12,fused@focc8 --tps 8 --batches 1,2,8 --tokens 1,4,8 --no-progress --out $M/moe_focc_${GT}_check_verify.csv" ;;
    moe-run49) echo "$KD moe --executors stock,fused,fused@skeys,fused@tring0,fused@skeys-tring0 --tps 8 --batches 1,2,8 --no-progress --out $M/moe_run49_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@skeys-tring0 --tps 8 --batches 1 --no-progress --out $M/moe_breakdown_run49_${GT}_tp8.csv" ;;
    moe-fring) echo "$KD moe --executors stock,fused,fused@fring,fused@tring0,fused@fring-tring0 --tps 8 --batches 1,2,8 --no-progress --out $M/moe_fring_${GT}_tp8.csv && $KD moe --breakdown --executors fused,fused@fring --tps 8 --batches 1 --no-progress --out $M/moe_breakdown_fring_${GT}_tp8.csv" ;;
    moe-breakdown-focc) echo "$KD moe --breakdown --executors fused,fused@focc12 --tps 8 --batches 1 --no-progress --out $M/moe_breakdown_focc_${GT}_tp8.csv" ;;
    moe-cand) echo "$KD moe --executors stock,fused,fused@cand0 --tps 8 --batches 1,2,4,8 --no-progress --out $M/moe_cand_${GT}_tp8.csv" ;;
    moe-breakdown-cand) echo "$KD moe --breakdown --executors fused,fused@cand0 --tps 8 --batches 1,2,8 --no-progress --out $M/moe_breakdown_cand_${GT}_tp8.csv" ;;
    moe-pdl) echo "$KD moe --executors stock,fused,fused-pdl,fused-nopdl --tps 8 --batches 1,2,3,4,6,8,17,64 --no-progress --out $M/moe_pdl_${GT}_tp8.csv" ;;
    moe-mtfit) echo "$PY -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k 'fitted_m_tile' && $KD moe --executors stock,fused,fused@mtfit0 --tps 8 --batches 1,2,3,4,8 --no-progress --out $M/moe_mtfit_${GT}_tp8.csv" ;;
    profile-fring) echo "$KD profile --executor fused-moe@fring --layer kda_moe --tp 8 --batch 1 && $KD profile --executor fused-moe@fring --layer kda_moe --tp 8 --batch 1 --metrics stalls --source 'front_ring'" ;;
    profile-route-b8) echo "$KD profile --executor fused5-moe --layer kda_moe --tp 8 --batch 8 --metrics stalls --source 'route_kernel'" ;;
    mma-rate) echo "$KD mma-rate --no-progress --out $M/mma_rate_${GT}.csv" ;;
    profile-fused-b1) echo "$KD profile --executor fused-moe --layer kda_moe --tp 8 --batch 1 && $KD profile --executor fused-moe --layer kda_moe --tp 8 --batch 8" ;;
    profile-moe) echo "for b in 1 8 64; do for e in fused-moe stock-moe; do $KD profile --executor \$e --layer kda_moe --tp 8 --batch \$b || exit 1; done; done" ;;
    profile-fused) echo "for b in 1 8 64; do $KD profile --executor fused-moe --layer kda_moe --tp 8 --batch \$b || exit 1; done; for b in 1 8; do $KD profile --executor fused5-moe --layer kda_moe --tp 8 --batch \$b || exit 1; done" ;;
    dcp-tests) echo "$PY -m pytest -q -p no:cacheprovider tests/test_stock_dcp.py tests/test_stock_triton_mla.py" ;;
    dcp-sweep) echo "$KD sweep --executor stock --tps 8 --layers mla_moe --batches 1,8,64 --contexts 8192,32768 --dcps 1,2,4,8 --no-progress --out $M/stock_dcp_${GT}_tp8.csv" ;;
    dcp-check-verify) echo "$KD sweep --executor stock --check-only --tps 8,16 --layers mla_moe --batches 1,17,64 --contexts 8192 --tokens 1,4,8 --dcps 2,8 --no-progress --out $M/stock_dcp_${GT}_check_verify.csv" ;;
    multi-gpu) echo "G=\$(nvidia-smi -L | wc -l); D=\$($PY -c \"import sys; g=int(sys.argv[1]); print(','.join(str(d) for d in (1,2,4,8) if g % d == 0))\" \$G); $PY -m kimi_decode.multi_gpu --gpus \$G --shard-tp 8 --layers kda_moe,mla_moe,dense --batches 1,64 --dcps \$D --allreduce nccl,oneshot --out $M/multi_gpu_${GT}_\${G}gpus.csv" ;;
    oneshot-dryrun) echo "$PY -m kimi_decode.multi_gpu --gpus 1 --shard-tp 8 --layers dense,mla_moe --batches 1 --allreduce nccl,oneshot --out $M/multi_gpu_oneshot_dryrun_${GT}.csv" ;;
    nccl-dryrun) echo "$PY -m kimi_decode.multi_gpu --gpus 1 --shard-tp 8 --layers kda_moe,dense --batches 1 --out $M/multi_gpu_dryrun_${GT}.csv" ;;
    compile-tp8-mla) echo "$KD sweep --executor compile --tps 8 --layers mla_moe --no-progress --out $M/compile_${GT}_tp8_mla.csv" ;;
    compile-tp8-mla-b64-32k) echo "$KD sweep --executor compile --tps 8 --layers mla_moe --batches 64 --contexts 32768 --no-progress --out $M/compile_${GT}_tp8_mla_b64_32k.csv" ;;
    compile-tp16-min) echo "$KD sweep --executor compile --tps 16 --batches 1,64 --contexts 8192 --no-progress --out $M/compile_${GT}_tp16.csv" ;;
    compile-tp16-b8-b32) echo "$KD sweep --executor compile --tps 16 --batches 8,32 --contexts 8192 --no-progress --out $M/compile_${GT}_tp16_b8_b32.csv" ;;
    compile-tp16-mla-32k) echo "$KD sweep --executor compile --tps 16 --layers mla_moe --batches 1,8,32,64 --contexts 32768 --no-progress --out $M/compile_${GT}_tp16_mla_32k.csv" ;;
    compile-tp8-min) echo "$KD sweep --executor compile --tps 8 --batches 1,64 --contexts 8192 --no-progress --out $M/compile_${GT}_tp8.csv" ;;
    profile-stock-b1) echo "for l in kda_moe mla_moe dense; do $KD profile --executor stock --layer \$l --tp 8 --batch 1 || exit 1; done" ;;
    profile-cute) echo "for b in 1 64; do $KD profile --executor cute-kernels --layer kda_moe --tp 8 --batch \$b || exit 1; done" ;;
    profile-stock-b64) echo "for l in kda_moe mla_moe dense; do $KD profile --executor stock --layer \$l --tp 8 --batch 64 || exit 1; done" ;;
    *) return 1 ;;
  esac
}

echo "=== card tag: $GT (output files *_${GT}_*)"
for spec in "$@"; do
  name=${spec%%:*}; limit=${spec#*:}; [ "$limit" = "$spec" ] && limit=300
  cmd=$(stage_cmd "$name") || { echo "=== unknown stage $name"; continue; }
  start=$(date +%s)
  left=$(( END - start )); [ "$limit" -gt "$left" ] && limit=$left
  if [ "$left" -lt 15 ]; then echo "=== $name skipped: no time left"; continue; fi
  echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
  timeout -k 5 "$limit" bash -c "$cmd" >"$LOGS/$name.log" 2>&1
  rc=$?
  echo "=== $name rc=$rc in $(( $(date +%s) - start ))s"
  grep -vE '^\s*$' "$LOGS/$name.log" | tail -n 25
  mkdir -p "$M/logs" && cp "$LOGS"/*.log "$M/logs/"
  tar -czf "$OUT/evidence.tar.gz" "$M" profiles
done
[ -f "$OUT/evidence.tar.gz" ] && echo "=== wrote $OUT/evidence.tar.gz ($(du -h "$OUT/evidence.tar.gz" | cut -f1))"
