#!/usr/bin/env bash
# Serving on one H200 (device tool, kind nvidia-h200): random weights at real shapes, no model to carry.
# Rows go to $STIEFKV_RESULTS_DIR (default $OUT) as each measurement finishes; every step's output is
# appended to $STIEFKV_RESULTS_DIR/run.log (see run_speed_gpu.sh for the provenance variables to pass).
#   usage: run_serve_gpu.sh STEP...    (steps, run in the order given:)
#     tests      the CUDA tests of the kernels over codes and of the static cache / captured decode
#     dequant    the CUDA tests of the one-pass dequantization and of the prefill over codes (~1 minute)
#     quant      bench_attention.py --tables quant (decode over int8/int4 codes against SDPA, 4 shapes)
#     serve      bench_serve.py, Llama-3-8B shapes, 8x16k, 50 % ranks: bf16 both key modes, int8 and int4
#     compacted  bench_serve.py 8x16k, 50 % bf16 in both key modes, beside the same cache of the prompt
#                compacted to 0.1 of its tokens (stiefkv.generate's static cache holding stiefkv.compact's entries)
#     serve_all  bench_serve.py, 8b and 1b, the issue's three batch x context cases, pre_rope bf16
#     capacity   bench_serve.py --capacity at 32k under 40 GiB: 50 % bf16 beside int8 (quantization only,
#                53.5 %), and 12.5 % (r 56 x int4) beside KIVI-2 (17.3 %)
#     capacity12 the 12.5 % capacity run alone, beside KIVI-2 (about 4 minutes)
#     serveq     bench_serve.py 8x16k with a quantization-only cache of about the same bytes served beside
#                StiefKV: 50 % bf16 / int8 (53.5 %), 50 % ranks x int8 (26.7 %) / int4 (28.1 %), both key modes
#     capacity12post the same bytes with post_rope keys (ranks 56 x int4; its int4 kernel is ~2x faster),
#                its search from 45 rows (45 in the twelfth session; a trial at 45 rows ~2 minutes)
#     capacity12whole  capacity12post with the prefill over codes dequantizing the whole cache at once (the
#                default before PREFILL_CODE_SLICE = 4096)
#     capacity12kivi capacity12post beside KIVI-2 (quantization only, 17.3 %): the same-bytes baseline,
#                StiefKV from 46 rows and KIVI-2 from 22 (thirteenth session: 16 and 17 KIVI-2 rows fit,
#                122 and 127 s a trial; 28 and 27 ran out of memory after 118 and 213 s; StiefKV's 46-row
#                trial 99 s): over one call's 10 minutes; the search gallops then bisects (bench_serve.boundary)
#     capacity12filled capacity12kivi with --fill-first (each trial's cache written directly up to its last
#                two prefill forwards, which run): seconds a trial; compare its boundaries with the prefilled
#                runs' (uncompressed 5/6, StiefKV 46/47 at 9d430a7) before quoting it
#     widesweep  the int4 post_rope kernel's sweep (prefetch off at the wide tile among it) at 4x128k, 16x16k,
#                29x32k and 43x32k, r 56 (prefetch off took 0.596 -> 0.481 ms at 43x32k, eleventh session)
#     windowtests the CUDA tests of the static cache's windowed stores and of CodesAndBand (a prefill over
#                windowed codes reads the codes below its exact band in slices; thirteenth session, CPU only)
#     windowprefill one prefill forward at 43x32k, int4 codes beside int4 behind a 16-token exact window
#     prefillprof one prefill forward (4096 tokens over the rows) at capacity: the 12.5 % post_rope cache at
#                43x32k in 4096-key slices and whole, the uncompressed cache at 5x32k (where the 43-row
#                trial's 286 s of prefill go, against 17 s for 5 uncompressed rows)
#     capacitypost  the 50 % capacity run with post_rope keys, beside int8 (quantization only)
#     context    bench_serve.py --context-capacity (one row, the cache filled directly): 50 % and 12.5 %
#     window     bench_serve.py 8x16k with int8 codes behind a 16-token exact window (what --bits auto keeps
#                at 50 %: codes read in place beside the ring), both key modes
#     compiled   bench_serve.py 8x16k, 50 % pre_rope, with transformers' compiled static-cache generate
#                beside the captured paths (its compilation takes minutes)
#     autostorage  needs MODEL (SmolLM2's GGUF): its --bits auto checkpoints at $BUDGETS (default 0.25; ~40 s
#                each, kept in $STIEFKV_RESULTS_DIR/ck), each checkpoint's storage served at 8x16k with
#                Llama-3-8B shapes in both key modes (bench_serve.py --storage-from; ~100 s a run, so about
#                two budgets fit one call)
#     keyauto    needs MODEL: at each of $BUDGETS (default 0.5) the default checkpoint and a --key-mode auto
#                one (calibrated side by side, kept in $STIEFKV_RESULTS_DIR/ck), each storage served at 8x16k
#                (Llama-3-8B shapes) in its own key mode beside the quantization-only cache $BASELINE
#                (default int8): whether auto's post_rope pays where it is chosen
#     storageprof  after autostorage (same BUDGETS): profile_serve_step.py --storage-from on each checkpoint,
#                as calibrated and with each storage feature taken away, both key modes (~4 minutes each)
#     fadd       the compiled sin/cos tests (sincos_fadd among them), then the pre_rope decode over bf16 and
#                int4 latents with and without sincos_fadd at 16x16k and 4x128k, and int4 r 56 at 45x32k
#                (~3 minutes with compilation)
#     faddall    with sincos_fadd the default: the compiled pre_rope decode tests, then pre_rope decode over
#                bf16, int8, int4, int3 and int2 at r 64, bf16 and int4 at r 32 (four shapes), int4 and int3
#                channel keys at r 112, each beside FRND's rounding and the bf16 ceiling; then serve 8x16k
#     smolcal    needs MODEL: SmolLM2's --bits auto checkpoint at $BUDGETS (one, default 0.125) per head and
#                with --share-heads, calibrated side by side (with any $EXTRA_BUDGETS per head), kept in
#                $STIEFKV_RESULTS_DIR/ck (~2.5 minutes)
#     smolserve  each of $SMOLCKS (default: smolcal's two, per head first) served at SmolLM2's own shapes
#                ($SMOLCASES, default 32x8000) beside the uncompressed cache and $BASELINE (default kivi2),
#                ~4 minutes each: one a call after smolcal (carry the checkpoints back in .ck and name them)
#     smolprof   profile_serve_step.py at SmolLM2's shapes on each of $SMOLCKS, the first with --key-mode
#                auto and its prefill forward (37.5 s against 5.5 s uncompressed on our kernels, 32x8000)
#     smolcap    the first of $SMOLCKS: its largest batch at 8000 tokens under $CAP_GIB (default 4) GiB at
#                SmolLM2's shapes, beside the uncompressed cache and $BASELINE, with tokens/s at each capacity
#     smolkernel bench_attention.py --heads smollm2: the decode table and the quant sweep (bf16, int4, int2 at
#                r 32) at SmolLM2's attention shapes, $SMOLCASES (default 32x8192): whether the defaults,
#                tuned at Llama-3-8B's, hold where d is 64 and three query heads share a KV head
#     occsplit   the key splits from the compiled kernel's occupancy (lowrank._occupancy_splits): its CUDA
#                tests, which launches take more splits than the rule (occupancy_splits.py, no timing), then
#                the quant table at SmolLM2's shapes ($SMOLCASES, r 32 and 64, bf16/int4/int2) with the
#                rule's count among the sweep (--sweep-with splits prefetch keys_left)
#     writetests the CUDA tests of the write kernels: quantize-on-write and the int8 window's round trip,
#                decode and prefill chunks, bit for bit the PyTorch write (~1 minute)
#     ncupre     Nsight Compute's stall reasons, issue slots and XU-pipe count of the pre_rope decode over
#                bf16 and int4 latents at 4x128k (~40 s; 2026-12-06's table in docs/notes/kernel-tries.md)
#     ckserve    needs CK (a --storage-from checkpoint, e.g. .ck/a125.safetensors carried): its storage at
#                8x16k per layer (--key-mode auto), then at capacity (32k, 40 GiB, --fill-first) beside
#                $BASELINE (default kivi2), then profile_serve_step.py at $ROWS rows (default 43) in each key
#                mode (~10 minutes in all: split it over calls with CKSTEPS="serve capacity profile")
#     capacitypre  the pre_rope capacity runs with the cache filled directly: 12.5 % (r 56 x int4) beside
#                KIVI-2, then 50 % beside int8 (the H200's pre_rope capacity rows predate --fill-first)
#     h200claims on an H200: the issue's kernel claims again (the bf16 decode table in both key modes at
#                16x16k and 4x128k, int4 post_rope at 4x128k), then serve 8x16k pre_rope (~6 minutes; the
#                rows in BENCHMARKS.md date from before sincos_fadd, the wide int4 tile and ahead)
set -u
source "$(dirname "$0")/gpu_run.sh"
serve() { step "serve $*" python3 benchmarks/bench_serve.py "$@"; }
NCU_METRICS='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__issue_active.avg.per_cycle_active,'\
'smsp__inst_executed.sum,sm__cycles_elapsed.avg,smsp__warps_active.avg.per_cycle_active,smsp__inst_executed_pipe_xu.sum'
smol_cks() {  # smolcal's checkpoints at $BUDGETS, per head first
  local name; name=$(auto_name "${BUDGETS:-0.125}")
  echo "$STIEFKV_RESULTS_DIR/ck/$name.safetensors $STIEFKV_RESULTS_DIR/ck/${name}s.safetensors"
}
auto_name() { echo "auto$(python3 -c "print(f'{float($1) * 100:g}')")"; }  # auto25, auto12.5: rows' case names
checkpoint() {  # checkpoint NAME BUDGET [CALIBRATE ARGS]: $STIEFKV_RESULTS_DIR/ck/NAME.safetensors, made once
  local name=$1 budget=$2; shift 2
  mkdir -p "$STIEFKV_RESULTS_DIR/ck"
  [ -f "$STIEFKV_RESULTS_DIR/ck/$name.safetensors" ] || step "calibrate $name" stiefkv calibrate "$MODEL" \
    --device cuda --budget "$budget" "$@" -o "$STIEFKV_RESULTS_DIR/ck/$name.safetensors"
}
for s in "$@"; do
  case $s in
    tests) step tests python3 -m pytest -q -ra -p no:cacheprovider tests/test_serve.py \
             tests/test_lowrank_kernel.py \
             -k "quantized or valid or serve or static or captured or filled or prefetch or no_reads" ;;
    dequant)
      step dequant python3 -m pytest -q -ra -p no:cacheprovider tests/test_dequantize_kernel.py
      step prefill-codes python3 -m pytest -q -ra -p no:cacheprovider tests/test_lowrank_kernel.py \
        -k prefill_over_codes ;;
    quant) step quant python3 benchmarks/bench_attention.py --tables quant ;;
    serve)
      serve --shape 8b --cases 8x16384 --key-mode pre_rope
      serve --shape 8b --cases 8x16384 --key-mode post_rope
      serve --shape 8b --cases 8x16384 --key-mode post_rope --bits 8
      serve --shape 8b --cases 8x16384 --key-mode post_rope --bits 4 ;;
    compacted)  # decode over a compacted prompt (stiefkv.generate after stiefkv.compact), 10x fewer tokens
      serve --shape 8b --cases 8x16384 --key-mode pre_rope --compact 0.1
      serve --shape 8b --cases 8x16384 --key-mode post_rope --compact 0.1 ;;
    serve_all)
      serve --shape 8b --cases 8x16384 1x32768 32x8192
      serve --shape 1b --cases 8x16384 1x32768 32x8192 ;;
    capacity)
      serve --shape 8b --capacity --context 32768 --cap-gib 40 --new-tokens 32 --baseline-cache int8
      serve --shape 8b --capacity --context 32768 --cap-gib 40 --new-tokens 32 --budget 0.4375 --bits 4 \
        --baseline-cache kivi2 ;;
    serveq)
      for mode in pre_rope post_rope; do
        serve --shape 8b --cases 8x16384 --key-mode $mode --baseline-cache int8
        serve --shape 8b --cases 8x16384 --key-mode $mode --bits 8 --baseline-cache int4
      done ;;
    window)
      serve --shape 8b --cases 8x16384 --key-mode pre_rope --bits 8 --recent 16
      serve --shape 8b --cases 8x16384 --key-mode post_rope --bits 8 --recent 16 ;;
    context)
      serve --shape 8b --context-capacity --cap-gib 40 --new-tokens 32
      serve --shape 8b --context-capacity --cap-gib 40 --new-tokens 32 --budget 0.4375 --bits 4 ;;
    compiled)
      serve --shape 8b --cases 8x16384 --key-mode pre_rope --compiled ;;
    capacity12)
      serve --shape 8b --capacity --context 32768 --cap-gib 40 --new-tokens 32 --budget 0.4375 --bits 4 \
        --baseline-cache kivi2 ;;
    capacity12post)
      serve --shape 8b --capacity --context 32768 --cap-gib 40 --new-tokens 32 --budget 0.4375 --bits 4 \
        --key-mode post_rope --start-batch 45 ;;
    capacity12kivi)
      serve --shape 8b --capacity --context 32768 --cap-gib 40 --new-tokens 32 --budget 0.4375 --bits 4 \
        --key-mode post_rope --start-batch 46 --baseline-cache kivi2 --baseline-start-batch 22 ;;
    capacity12filled)
      serve --shape 8b --capacity --context 32768 --cap-gib 40 --new-tokens 32 --budget 0.4375 --bits 4 \
        --key-mode post_rope --baseline-cache kivi2 --fill-first ;;
    widesweep)
      step widesweep python3 benchmarks/bench_attention.py --tables quant --bits 4 --modes post_rope \
        --shapes 4x131072 16x16384 29x32768 43x32768 --rank 56 ;;
    windowtests) step windowtests python3 -m pytest -q -ra -p no:cacheprovider tests/test_serve.py \
      tests/test_dequantize_kernel.py -k "windowed or layout or band or quantized or tokens" ;;
    windowprefill)
      step prefill-window python3 benchmarks/experiments/profile_serve_step.py --prefill --key-mode post_rope \
        --budget 0.4375 --case 43x32768 --stores "int4 codes,int4 r16" --fused-writes on ;;
    prefillprof)
      prof="python3 benchmarks/experiments/profile_serve_step.py --prefill --key-mode post_rope --budget 0.4375"
      step prefill-sliced $prof --case 43x32768 --stores "int4 codes" --fused-writes on
      step prefill-whole $prof --case 43x32768 --stores "int4 codes" --fused-writes on --code-slice 0
      step prefill-uncompressed $prof --case 5x32768 --stores "uncompressed (our kernels)" ;;
    capacity12whole)
      serve --shape 8b --capacity --context 32768 --cap-gib 40 --new-tokens 32 --budget 0.4375 --bits 4 \
        --key-mode post_rope --code-slice 0 ;;
    capacitypost)
      serve --shape 8b --capacity --context 32768 --cap-gib 40 --new-tokens 32 --key-mode post_rope \
        --baseline-cache int8 ;;
    autostorage)
      ck="$STIEFKV_RESULTS_DIR/ck"
      for b in ${BUDGETS:-0.25}; do
        name=$(auto_name "$b")
        checkpoint "$name" "$b"
        for mode in pre_rope post_rope; do
          serve --shape 8b --cases 8x16384 --storage-from "$ck/$name.safetensors" --key-mode $mode \
            --baseline-cache kivi4  # the quantization a user would pick near 25 %, in the same run
        done
      done ;;
    keyauto)
      ck="$STIEFKV_RESULTS_DIR/ck"
      for b in ${BUDGETS:-0.5}; do
        name=$(auto_name "$b")
        checkpoint "$name" "$b" &
        checkpoint "${name}k" "$b" --key-mode auto &
        wait
        for c in "$name" "${name}k"; do
          serve --shape 8b --cases 8x16384 --storage-from "$ck/$c.safetensors" \
            --baseline-cache "${BASELINE:-int8}"
        done
      done ;;
    storageprof)  # after autostorage: where each calibrated storage's decode step goes, both key modes
      for b in ${BUDGETS:-0.25}; do
        name=$(auto_name "$b")
        for mode in pre_rope post_rope; do
          step "profile $name $mode" python3 benchmarks/experiments/profile_serve_step.py --case 8x16384 \
            --storage-from "$STIEFKV_RESULTS_DIR/ck/$name.safetensors" --key-mode $mode --rows 8
        done
      done ;;
    fadd)
      step sincos python3 -m pytest -q -ra -p no:cacheprovider tests/test_lowrank_kernel.py \
        -k "sincos or turns"
      step fadd python3 benchmarks/bench_attention.py --tables quant --bits 16 4 --modes pre_rope \
        --shapes 16x16384 4x131072 --sweep-with sincos_fadd
      step fadd-capacity python3 benchmarks/bench_attention.py --tables quant --bits 4 --modes pre_rope \
        --shapes 45x32768 --rank 56 --sweep-with sincos_fadd ;;
    faddall)  # sincos_fadd as the default: FRND's rounding and the bf16 register ceiling beside it
      step faddtests timeout 420 python3 -m pytest -q -ra -p no:cacheprovider tests/test_lowrank_kernel.py \
        -k "pre_rope and (decode or sincos or turns)"
      q="python3 benchmarks/bench_attention.py --tables quant --modes pre_rope --sweep-with sincos_fadd"
      step fadd-r64 $q --bits 16 8 4 3 2 --shapes 1x32768 8x8192 16x16384 4x131072
      step fadd-r32 $q --bits 16 4 --rank 32 --shapes 1x32768 8x8192 16x16384 4x131072
      step fadd-channel $q --bits 4 3 --rank 112 --channel-keys --shapes 8x16384 4x131072
      serve --shape 8b --cases 8x16384 --key-mode pre_rope ;;
    smolcal)  # needs MODEL: SmolLM2's --bits auto checkpoints, per head and shared, side by side
      b=${BUDGETS:-0.125}
      name=$(auto_name "$b")
      checkpoint "$name" "$b" &
      checkpoint "${name}s" "$b" --share-heads &
      for extra in ${EXTRA_BUDGETS:-}; do checkpoint "$(auto_name "$extra")" "$extra" & done
      wait ;;
    smolserve)  # each of $SMOLCKS at SmolLM2's own shapes beside the uncompressed cache and $BASELINE
      for c in ${SMOLCKS:-$(smol_cks)}; do
        serve --shape smollm2 --cases ${SMOLCASES:-32x8000} --storage-from "$c" \
          --baseline-cache "${BASELINE:-kivi2}" --rounds 2
      done ;;
    smolprof)  # where each of $SMOLCKS's decode step goes at SmolLM2's shapes; the first's prefill, and
      for c in ${SMOLCKS:-$(smol_cks)}; do  # its step with --key-mode auto
        step "profile $(basename "$c")" python3 benchmarks/experiments/profile_serve_step.py --shape smollm2 \
          --case ${SMOLCASES:-32x8000} --storage-from "$c" --rows 8 --variants "as calibrated"
      done
      c=$(echo ${SMOLCKS:-$(smol_cks)} | cut -d' ' -f1)
      step "profile $(basename "$c") key-mode auto" python3 benchmarks/experiments/profile_serve_step.py \
        --shape smollm2 --case ${SMOLCASES:-32x8000} --storage-from "$c" --key-mode auto --rows 8 \
        --variants "as calibrated"
      step "profile $(basename "$c") prefill" python3 benchmarks/experiments/profile_serve_step.py --prefill \
        --shape smollm2 --case ${SMOLCASES:-32x8000} --storage-from "$c" --rows 12 --variants "as calibrated" ;;
    smolcap)  # the first of $SMOLCKS at capacity at SmolLM2's shapes under a small cap
      c=$(echo ${SMOLCKS:-$(smol_cks)} | cut -d' ' -f1)
      serve --shape smollm2 --capacity --context 8000 --cap-gib ${CAP_GIB:-4} --new-tokens 32 --fill-first \
        --storage-from "$c" --baseline-cache "${BASELINE:-kivi2}" ;;
    smolkernel)  # the decode kernel at SmolLM2's attention shapes (H 9, G 3, d 64), default and the sweep
      step smolkernel python3 benchmarks/bench_attention.py --heads smollm2 --tables decode quant \
        --shapes ${SMOLCASES:-32x8192} --bits 16 4 2 ;;
    writetests) step writetests python3 -m pytest -q -ra -p no:cacheprovider tests/test_serve.py \
                  tests/test_quantize_kernel.py -k "quantize_on_write or round_trip or quantize_into" ;;
    occsplit)
      step occtests python3 -m pytest -q -ra -p no:cacheprovider tests/test_lowrank_kernel.py \
        -k "occupancy or return_config or decode_splits"
      step occlist python3 benchmarks/experiments/occupancy_splits.py
      for r in 32 64; do
        step "occsplit r$r" python3 benchmarks/bench_attention.py --heads smollm2 --tables quant \
          --shapes ${SMOLCASES:-32x8192} --bits 16 4 2 --rank $r --sweep-with splits prefetch keys_left
      done ;;
    ncupre)
      for b in 16 4; do
        step "ncu pre_rope bits $b" ncu --clock-control none --kernel-name regex:_lowrank_attn_fwd \
          --launch-skip 2 --launch-count 1 --section SpeedOfLight --metrics "$NCU_METRICS" \
          python3 benchmarks/experiments/ncu_decode.py --bits $b --key-mode pre_rope
      done ;;
    ckserve)
      if [ -z "${CK:-}" ] || [ ! -f "$CK" ]; then
        echo "ckserve needs CK=a checkpoint file carried to the device (got '${CK:-}')" >> "$LOG"; continue
      fi
      for part in ${CKSTEPS:-serve capacity profile}; do
        case $part in
          serve) serve --shape 8b --cases 8x16384 --storage-from "$CK" --key-mode auto --rounds 2 ;;
          capacity) serve --shape 8b --capacity --context 32768 --cap-gib 40 --new-tokens 32 --fill-first \
                      --storage-from "$CK" --key-mode auto --baseline-cache "${BASELINE:-kivi2}" --rounds 2 ;;
          profile)
            for mode in auto pre_rope post_rope; do
              step "profile $mode" python3 benchmarks/experiments/profile_serve_step.py \
                --case "${ROWS:-43}x32768" --storage-from "$CK" --key-mode $mode --rows 6 --no-uncompressed \
                --variants "as calibrated"
            done ;;
        esac
      done ;;
    capacitypre)
      serve --shape 8b --capacity --context 32768 --cap-gib 40 --new-tokens 32 --budget 0.4375 --bits 4 \
        --key-mode pre_rope --baseline-cache kivi2 --fill-first
      serve --shape 8b --capacity --context 32768 --cap-gib 40 --new-tokens 32 --key-mode pre_rope \
        --baseline-cache int8 --fill-first ;;
    h200claims)
      step decode python3 benchmarks/bench_attention.py --tables decode --modes pre_rope post_rope \
        --shapes 16x16384 4x131072
      step quant4post python3 benchmarks/bench_attention.py --tables quant --bits 4 --modes post_rope \
        --shapes 4x131072
      serve --shape 8b --cases 8x16384 --key-mode pre_rope --rounds 2 ;;
    *) echo "unknown step $s" >> "$LOG" ;;
  esac
done
tail -n 60 "$LOG"
