#!/usr/bin/env bash
# GPU validation on a CUDA machine with vLLM 0.26 and this plugin installed, stage by stage, in the
# order of value per minute (each stage fits a 10-minute slot; STAGE_LIMIT bounds one). Logs go to $LOG_DIR (default ./gpu-logs).
#
#   scripts/gpu_check.sh unit          # our kernels + modules against their references (~4 min)
#   scripts/gpu_check.sh changed       # the GPU tests of what changed since the last device run (CHANGED_TESTS),
#                                      # a pytest process per file, side by side
#   scripts/gpu_check.sh compiles      # no compile of our Triton kernels while an engine serves (one engine run)
#   scripts/gpu_check.sh vllm-kernels  # the vLLM kernels we bind (FP8 GEMMs, Marlin MoE) against our references;
#                                      # DeepGEMM compiles each new shape first (~20 s each, minutes in all)
#   scripts/gpu_check.sh e2e           # vLLM e2e on GPU: chunked prefill, preemption, FP8 KV, prefix cache (~6 min)
#   scripts/gpu_check.sh gpu-path      # GPU path vs reference path, 16 x 512 greedy tokens (>7 min)
#   scripts/gpu_check.sh gpu-path-flash  # the same at V4-Flash dimensions (6 layers, top-64 log-probs)
#   scripts/gpu_check.sh gpu-path-base   # the same for V4-Flash-Base's format (FP8 experts; 4 layers at V4-Flash dims)
#   scripts/gpu_check.sh graph-ops     # each decode op replayed from a CUDA graph vs eager, bit for bit (~1 min)
#   scripts/gpu_check.sh graphs        # 128 tokens x 16 prompts with CUDA-graph decode vs eager, batch-invariant
#                                      # (bit for bit) and default (within the FP8 noise bound): four engine runs
#   scripts/gpu_check.sh graph-checks  # eager vs eager, and eager on garbage-filled pages with NaN-filled
#                                      # allocations (three engine runs): tell run-to-run variation and
#                                      # reads of unwritten memory from replay errors when `graphs` fails
#   scripts/gpu_check.sh mtp           # MTP speculative decoding (k = 1, 2) vs transformers: draft log-probs, greedy outputs
#   scripts/gpu_check.sh dspark        # DSpark: the drafter's intermediates vs the spec reference, greedy outputs (N = 1..7,
#                                      # prefix cache, chunks, connector, TP = 2 where 2 GPUs), CUDA-graph drafts vs eager,
#                                      # forced drafts (DSpark and MTP), probabilistic drafting's distribution
#   scripts/gpu_check.sh connector     # DSV4Connector: store/plan units, PD engines vs transformers, damaged entries
#   scripts/gpu_check.sh nixl          # DSV4NixlConnector (needs vllm-dsv4[nixl]): two servers on one GPU over NIXL
#                                      # vs transformers, MultiConnector + store, lease; then scripts/bench_connector.py
#                                      # (NIXL vs store vs recompute) on the 6-layer V4-Flash-dims checkpoint
#   scripts/gpu_check.sh vision        # images: preprocessing, tower and processor units, then prompts with one
#                                      # and two images vs the whole-model reference (tiny-vision, vLLM 0.26)
#   scripts/gpu_check.sh vision-flash  # Vision-Exp dimensions (4 text layers, the 32-layer tower): tower time per
#                                      # image (scripts/bench_vision.py), then one image prompt with CUDA graphs
#   scripts/gpu_check.sh harden        # the entry store under faults, pinned loads (vLLM 0.26: no store event may end
#                                      # the engine), then the short soak (two tiny-model servers, ~3 min)
#   scripts/gpu_check.sh piecewise     # chunked prefill replayed from piecewise (breakable) CUDA graphs vs eager
#   scripts/gpu_check.sh graph-launch  # scripts/bench_graph_launch.py: a CUDA graph launch's host cost per node, by kind
#   scripts/gpu_check.sh bench-kernels # scripts/bench_kernels.py: each op vs its reference; fused wo_a vs per-group
#                                      # GEMMs and our MoE vs vLLM's Marlin at decode and prefill sizes (~3 min)
#   scripts/gpu_check.sh bench-plugin  # scripts/bench_gpu.py, our engine, 6-layer V4-Flash-dims checkpoint;
#                                      # then scripts/trace_waits.py on its prefill and decode traces
#   scripts/gpu_check.sh bench-invariant  # our engine in batch-invariant mode (VLLM_DSV4_BATCH_INVARIANT=1: Triton MoE)
#   scripts/gpu_check.sh bench-fused   # our engine with the fused wo_a kernel at every size (VLLM_DSV4_OUT_PROJ=fused)
#   scripts/gpu_check.sh bench-einsum  # our engine with wo_a through DeepGEMM's grouped GEMM (VLLM_DSV4_OUT_PROJ=einsum)
#   scripts/gpu_check.sh bench-chunk2048  # our engine attending 2,048 queries per call (the reference path's chunk; the kernels take 8,192)
#   scripts/gpu_check.sh bench-intree  # vLLM's in-tree DeepSeek-V4 on the same checkpoint; then `report`
#                                      # (MTP=K before either: both engines draft K tokens per step;
#                                      # FIRST_START=1: each engine started once before, that start reported too;
#                                      # JIT_ROOT=DIR: with it, each engine's JIT caches empty at its first start)
#   scripts/gpu_check.sh bench-serve   # scripts/bench_serve.sh: vllm bench serve against both engines' servers
#                                      # (1k/128 and 8k/1k, concurrency 1, 16, 64 and the most that fit; ~15 min:
#                                      # SHAPES / CONCURRENCY narrow it to fit a call)
#   scripts/gpu_check.sh report        # the benchmark table from the two saved runs
#   scripts/gpu_check.sh save-caches   # the JIT caches as 15 MiB parts in $LOG_DIR (to carry to the next machine)
#   scripts/gpu_check.sh restore-caches  # unpack them from CACHE_PARTS (default .devcache) before the first engine
set -o pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${LOG_DIR:-gpu-logs}
FLASH=${FLASH_CKPT:-/tmp/dsv4-flash-6l}
FLASH_VISION=${FLASH_VISION_CKPT:-/tmp/dsv4-flash-vision-4l}
LIMIT=${STAGE_LIMIT:-560}  # seconds per stage; lower it to fit two stages into one device call
mkdir -p "$LOG_DIR"
export VLLM_PLUGINS=vllm_dsv4 PYTHONUNBUFFERED=1
# DeepGEMM's warm-up of every kernel choice (vLLM's default, which ours follows) takes many minutes on a
# fresh machine: the stages skip it unless asked (their engines then compile DeepGEMM kernels as needed)
export VLLM_DEEP_GEMM_WARMUP=${VLLM_DEEP_GEMM_WARMUP:-skip}
# Our warm-up steps compile every kernel variant a server may need (minutes of a cold start); the
# correctness stages' engines skip them and compile only what their steps use. The benchmarks time a start
# as users get it, and `compiles` checks that nothing compiles while serving: those keep the warm-up.
case "${1:-unit}" in
  bench-* | compiles) ;;
  *) export VLLM_DSV4_WARMUP=${VLLM_DSV4_WARMUP:-skip} ;;
esac
# the tests that run vLLM's kernels (slow to JIT-compile), in tests/model
VLLM_KERNEL_TESTS="vllm_block_fp8 or vllm_triton_fallback or grouped_wo_a_in_fp8 or vllm_picks or marlin_moe"
# not yet passed on a GPU: the FP8 (V4-Flash-Base) routed experts and the MXFP4 kernel file they now share;
# the MXFP4 experts' file with Marlin the default (the graph tests of both MoE modes: `graphs`)
CHANGED_TESTS="tests/csrc_triton/test_moe_fp8_kernel.py tests/model/test_experts_fp8.py
  tests/csrc_triton/test_moe_mxfp4_kernel.py tests/model/test_experts_mxfp4.py"
# the engine finds the plugin through its installed entry point: fail now, not after an engine start
python - <<'PY' || exit 1
import importlib.metadata as md
import sys
if not any(e.value.startswith("vllm_dsv4") for e in md.entry_points(group="vllm.general_plugins")):
    sys.exit(f"vllm_dsv4's entry point is not installed for {sys.executable}: "
             "run `python -m pip install --no-deps --no-build-isolation -e .` with this python")
PY
summary() { grep -E "passed|failed|compiles of our kernels|warm-up steps|GPU vs|CUDA graphs vs|eager vs eager|unwritten memory|first different token|^FAILED|^E  .*(Error|assert)|tok/s|\|" "$1" | head -40; }

flash_checkpoint() {  # drawn and quantised on the GPU: about a minute
  [ -f "$FLASH/config.json" ] || python scripts/make_checkpoint.py --preset flash --out "$FLASH" --device cuda | tail -1
}

case "${1:-unit}" in
  unit)
    timeout "$LIMIT" python -m pytest -q -p no:cacheprovider -rf --tb=line --durations=15 tests/csrc_triton tests/model tests/ops tests/kv tests/loader tests/connector \
      -k "not ($VLLM_KERNEL_TESTS)" > "$LOG_DIR/unit.log" 2>&1; summary "$LOG_DIR/unit.log" ;;
  changed)  # one pytest process per file, side by side: Triton's compiles, which dominate, use one CPU each,
    # and a device-side assert (which leaves its process's CUDA context unusable) fails one file only
    [ -n "$CHANGED_TESTS" ] || { echo "CHANGED_TESTS is empty: every changed test passed on a GPU"; exit 0; }
    pids=()
    for f in $CHANGED_TESTS; do
      timeout "$LIMIT" python -m pytest -q -p no:cacheprovider -rf --tb=short "$f" > "$LOG_DIR/changed.$(basename "$f" .py).log" 2>&1 &
      pids+=($!)
    done
    wait "${pids[@]}"
    for f in $CHANGED_TESTS; do
      log="$LOG_DIR/changed.$(basename "$f" .py).log"
      echo "$f: $(grep -E ' in [0-9.]+s( \(.*\))?$' "$log" | tail -1 || echo 'no summary (cut by STAGE_LIMIT?)')"
    done | tee "$LOG_DIR/changed.log"
    grep -hE "^FAILED|^ERROR" "$LOG_DIR"/changed.*.log | head -20 ;;
  compiles)
    timeout "$LIMIT" python -m pytest -q -s -p no:cacheprovider -rf --tb=short \
      tests/e2e/test_gpu_path.py::test_no_kernel_compiles_while_serving > "$LOG_DIR/compiles.log" 2>&1
    summary "$LOG_DIR/compiles.log" ;;
  vllm-kernels)
    timeout "$LIMIT" python -m pytest -q -p no:cacheprovider -rf --tb=line --durations=15 tests/model -k "$VLLM_KERNEL_TESTS" \
      > "$LOG_DIR/vllm_kernels.log" 2>&1; summary "$LOG_DIR/vllm_kernels.log" ;;
  e2e)
    timeout "$LIMIT" python -m pytest -q -p no:cacheprovider -rf --tb=short tests/e2e/test_generate.py \
      tests/e2e/test_prefix_cache.py -k "(chunked and 64) or preempt or fp8_kv or cache" > "$LOG_DIR/e2e.log" 2>&1; summary "$LOG_DIR/e2e.log" ;;
  gpu-path)
    timeout "$LIMIT" python -m pytest -q -s -p no:cacheprovider -rf --tb=short tests/e2e/test_gpu_path.py \
      -k "reference_path and not flash" > "$LOG_DIR/gpu_path.log" 2>&1; summary "$LOG_DIR/gpu_path.log" ;;
  gpu-path-flash)
    flash_checkpoint
    DSV4_FLASH_CKPT="$FLASH" timeout "$LIMIT" python -m pytest -q -s -p no:cacheprovider -rf --tb=short \
      tests/e2e/test_gpu_path.py -k flash_ckpt > "$LOG_DIR/gpu_path_flash.log" 2>&1; summary "$LOG_DIR/gpu_path_flash.log" ;;
  gpu-path-base)  # the checkpoint drawn on the GPU by the test (~1 min); DSV4_FLASH_BASE_CKPT names one made before
    timeout "$LIMIT" python -m pytest -q -s -p no:cacheprovider -rf --tb=short tests/e2e/test_gpu_path.py \
      -k flash_base_ckpt > "$LOG_DIR/gpu_path_base.log" 2>&1; summary "$LOG_DIR/gpu_path_base.log" ;;
  graph-ops)
    timeout "$LIMIT" python -m pytest -q -p no:cacheprovider -rf --tb=short tests/model/test_graph_replay.py \
      > "$LOG_DIR/graph_ops.log" 2>&1; summary "$LOG_DIR/graph_ops.log" ;;
  graphs)
    timeout "$LIMIT" python -m pytest -q -s -p no:cacheprovider -rf --tb=short tests/e2e/test_gpu_path.py \
      -k "cuda_graph" > "$LOG_DIR/graphs.log" 2>&1; summary "$LOG_DIR/graphs.log" ;;
  graph-checks)
    timeout "$LIMIT" python -m pytest -q -s -p no:cacheprovider -rf --tb=short tests/e2e/test_gpu_path.py \
      -k "reproducible or unwritten" > "$LOG_DIR/graph_checks.log" 2>&1; summary "$LOG_DIR/graph_checks.log" ;;
  mtp)
    timeout "$LIMIT" python -m pytest -q -p no:cacheprovider -rf --tb=short tests/e2e/test_mtp.py \
      > "$LOG_DIR/mtp.log" 2>&1; summary "$LOG_DIR/mtp.log" ;;
  dspark)
    timeout "$LIMIT" python -m pytest -q -p no:cacheprovider -rf --tb=short tests/e2e/test_dspark.py \
      tests/e2e/test_forced_drafts.py tests/e2e/test_dspark_sampling.py > "$LOG_DIR/dspark.log" 2>&1
    summary "$LOG_DIR/dspark.log" ;;
  vision)
    timeout "$LIMIT" python -m pytest -q -p no:cacheprovider -rf --tb=short tests/vision tests/model/test_image_window.py \
      tests/model/test_image_routing.py tests/test_patches.py -k "not server and (not test_patches or vision_patches \
      or pixel_limit)" > "$LOG_DIR/vision.log" 2>&1; summary "$LOG_DIR/vision.log" ;;
  vision-flash)
    [ -f "$FLASH_VISION/config.json" ] || python scripts/make_checkpoint.py --preset flash-vision --num-layers 4 \
      --vision-layers 32 --out "$FLASH_VISION" --device cuda | tail -1
    timeout "$LIMIT" python scripts/bench_vision.py --preset flash-vision --device cuda --repeat 10 \
      > "$LOG_DIR/bench_vision.log" 2>&1; cat "$LOG_DIR/bench_vision.log"
    DSV4_FLASH_VISION_CKPT="$FLASH_VISION" timeout "$LIMIT" python -m pytest -q -s -p no:cacheprovider -rf \
      --tb=short tests/vision/test_generate_images.py -k flash_vision > "$LOG_DIR/vision_flash.log" 2>&1
    summary "$LOG_DIR/vision_flash.log" ;;
  piecewise)
    timeout "$LIMIT" python -m pytest -q -s -p no:cacheprovider -rf --tb=short tests/e2e/test_gpu_path.py \
      -k piecewise > "$LOG_DIR/piecewise.log" 2>&1; summary "$LOG_DIR/piecewise.log" ;;
  harden)
    timeout "$LIMIT" python -m pytest -q -p no:cacheprovider -rf --tb=short tests/connector/test_store_faults.py \
      tests/connector/test_connector_faults.py tests/e2e/test_soak.py > "$LOG_DIR/harden.log" 2>&1
    summary "$LOG_DIR/harden.log" ;;
  connector)
    timeout "$LIMIT" python -m pytest -q -p no:cacheprovider -rf --tb=short tests/connector/test_plan.py \
      tests/connector/test_store.py tests/e2e/test_kv_connector.py > "$LOG_DIR/connector.log" 2>&1
    summary "$LOG_DIR/connector.log" ;;
  nixl)
    python -c "import nixl._api" || { echo "NIXL is not installed: python -m pip install nixl==1.5.1"; exit 1; }
    timeout "$LIMIT" python -m pytest -q -p no:cacheprovider -rf --tb=short tests/serving/test_pd_nixl.py \
      tests/test_compat.py tests/test_patches.py > "$LOG_DIR/nixl.log" 2>&1
    summary "$LOG_DIR/nixl.log"
    flash_checkpoint
    timeout "$LIMIT" python scripts/bench_connector.py --ckpt "$FLASH" --lens 8192 32768 --repeat 2 \
      --serve "--dtype bfloat16 --kv-cache-dtype fp8 --gpu-memory-utilization 0.4" > "$LOG_DIR/bench_connector.log" 2>&1
    tail -32 "$LOG_DIR/bench_connector.log" ;;
  graph-launch)
    timeout "$LIMIT" python scripts/bench_graph_launch.py > "$LOG_DIR/graph_launch.log" 2>&1; cat "$LOG_DIR/graph_launch.log" ;;
  bench-kernels)  # per-op table; wo_a and the experts against the other implementation the model can run
    timeout "$LIMIT" python scripts/bench_kernels.py > "$LOG_DIR/bench_kernels.log" 2>&1; tail -45 "$LOG_DIR/bench_kernels.log" ;;
  bench-plugin | bench-intree)
    engine=${1#bench-}
    flash_checkpoint
    timeout "$LIMIT" python scripts/bench_gpu.py --model "$FLASH" --engines "$engine" --out "$LOG_DIR/bench" --profile \
      --mtp "${MTP:-0}" ${FIRST_START:+--first-start} ${JIT_ROOT:+--jit-root "$JIT_ROOT"} \
      > "$LOG_DIR/bench_$engine.log" 2>&1; summary "$LOG_DIR/bench_$engine.log"
    # where the 8k prefill waits on the host (GPU idle gaps, syncs by the code that made them)
    python scripts/trace_waits.py "$LOG_DIR/bench.$engine.prefill.trace.json.gz" | head -40
    # where the host spends a batch-16 decode step (host-bound at 6 layers)
    python scripts/trace_waits.py "$LOG_DIR/bench.$engine.decode.trace.json.gz" --gaps 5 --frames 40 \
      > "$LOG_DIR/bench_$engine.decode_host.txt"; head -60 "$LOG_DIR/bench_$engine.decode_host.txt" ;;
  bench-invariant | bench-fused | bench-einsum | bench-chunk2048)  # our engine with another setting
    flash_checkpoint
    case $1 in
      bench-invariant) export VLLM_DSV4_BATCH_INVARIANT=1 ;;
      bench-fused) export VLLM_DSV4_OUT_PROJ=fused ;;
      bench-einsum) export VLLM_DSV4_OUT_PROJ=einsum ;;
      bench-chunk2048) export VLLM_DSV4_ATTN_QUERY_CHUNK=2048 ;;
    esac
    timeout "$LIMIT" python scripts/bench_gpu.py --model "$FLASH" --engines plugin --out "$LOG_DIR/$1" \
      > "$LOG_DIR/$1.log" 2>&1; summary "$LOG_DIR/$1.log" ;;
  bench-serve)
    flash_checkpoint
    OUT_DIR="$LOG_DIR/serve" timeout "$LIMIT" bash scripts/bench_serve.sh "$FLASH" > "$LOG_DIR/bench_serve.log" 2>&1
    tail -30 "$LOG_DIR/bench_serve.log" ;;
  report)
    python scripts/bench_gpu.py --report "$LOG_DIR"/bench.*.json --model "$FLASH" ;;
  save-caches)  # the JIT caches (Triton's for our kernels and vLLM's, DeepGEMM's, TileLang's) as 15 MiB parts
    # for the next machine, which would otherwise compile everything again (a cold engine start compiles for minutes)
    dirs=()
    for d in .triton/cache .cache/vllm .tilelang; do [ -d "$HOME/$d" ] && dirs+=("$d"); done
    (cd "$HOME" && du -sh "${dirs[@]}")
    tar -C "$HOME" -czf - "${dirs[@]}" | split -b 15M -d - "$LOG_DIR/jit-caches.tgz.part"
    parts=("$LOG_DIR"/jit-caches.tgz.part*)
    ls -l "${parts[@]}"
    [ ${#parts[@]} -le 4 ] || echo "${#parts[@]} parts: a device call returns 64 MiB at most; carry fewer caches" ;;
  restore-caches)  # what save-caches wrote, from CACHE_PARTS (a folder the call carries): every part or none
    parts=("${CACHE_PARTS:-.devcache}"/jit-caches.tgz.part*)
    cat "${parts[@]}" | tar -C "$HOME" -xzf - && echo "restored ${#parts[@]} parts" ;;
  *)
    echo "unknown stage $1" >&2; exit 2 ;;
esac
