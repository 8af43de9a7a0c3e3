#!/usr/bin/env bash
# Serving benchmark (not a test): vLLM's own `vllm bench serve` against `vllm-dsv4 serve` and against vLLM's
# in-tree DeepSeek-V4 on the same checkpoint, one server at a time on one GPU; random dataset at 1k-in /
# 128-out and 8k-in / 1k-out, concurrency 1, 16, 64 and the largest our KV budget fits (vLLM's reported
# maximum concurrency for that request length, at most MAX_SEQS); output tok/s, TTFT and TPOT (median,
# p99), and the most requests each server held waiting: the client never sends more than the concurrency
# and MAX_SEQS is above it, so a waiting request waits for KV space. Both engines get the same KV-cache
# bytes (KV_BYTES); each server is started per shape with max_model_len = input + output, so its reported
# capacity is that shape's. The table puts each figure beside its floor (scripts/floors.py).
#
#   scripts/bench_serve.sh CKPT                 # both engines, then the table ($OUT_DIR/report.md)
#   ENGINES=plugin scripts/bench_serve.sh CKPT  # one engine; REPORT_ONLY=1: the table of $OUT_DIR only
#   DRY_RUN=1 scripts/bench_serve.sh CKPT       # print the commands only
#
# Settings (environment): OUT_DIR (./serve-logs), KV_BYTES (16 GiB), MAX_SEQS (512), CAPTURE (largest
# CUDA-graph batch, 128), PORT (8123), SHAPES ("1024:128 8192:1024"), CONCURRENCY ("1 16 64"),
# PROMPTS (requests per level; default max(8, 4 x concurrency)), CARD (h200 | h100, for the floors).
set -o pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: scripts/bench_serve.sh CHECKPOINT}
OUT_DIR=${OUT_DIR:-serve-logs}
ENGINES=${ENGINES:-plugin intree}
KV_BYTES=${KV_BYTES:-$((16 * 1024 * 1024 * 1024))}
MAX_SEQS=${MAX_SEQS:-512}
CAPTURE=${CAPTURE:-128}
PORT=${PORT:-8123}
SHAPES=${SHAPES:-"1024:128 8192:1024"}
CONCURRENCY=${CONCURRENCY:-"1 16 64"}
CARD=${CARD:-h200}
mkdir -p "$OUT_DIR"
export VLLM_DEEP_GEMM_WARMUP=${VLLM_DEEP_GEMM_WARMUP:-skip} PYTHONUNBUFFERED=1

server_command() {  # engine max_len -> SERVER_CMD, the server's command; the checkpoint's own tokenizer for both
  local common=(--port "$PORT" --max-model-len "$2" --kv-cache-dtype fp8 --kv-cache-memory-bytes "$KV_BYTES"
                --max-num-seqs "$MAX_SEQS" --max-num-batched-tokens 8192 --no-enable-prefix-caching
                --compilation-config "{\"max_cudagraph_capture_size\": $CAPTURE}")
  case $1 in
    plugin) SERVER_CMD=(env VLLM_PLUGINS=vllm_dsv4 vllm-dsv4 serve "$MODEL" --plugin vllm_dsv4 --no-dsv4-defaults
                        "${common[@]}") ;;
    intree) SERVER_CMD=(env VLLM_PLUGINS=none vllm serve "$MODEL" "${common[@]}") ;;
  esac
}

max_concurrency() {  # a server log -> vLLM's "Maximum concurrency for N tokens per request" (floored)
  sed -n 's/.*Maximum concurrency for [0-9,]* tokens per request: \([0-9]*\).*/\1/p' "$1" | head -1
}

serve() {  # engine in out: start a server, run every concurrency level against it, stop it
  local engine=$1 in=$2 out=$3 log="$OUT_DIR/server.$1.$2-$3.log" pid started=$SECONDS largest
  server_command "$engine" $((in + out))
  if [ -n "$DRY_RUN" ]; then echo "+ ${SERVER_CMD[*]}"; else
    setsid "${SERVER_CMD[@]}" > "$log" 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
      kill -0 "$pid" 2> /dev/null || { echo "[$engine] server exited:"; tail -30 "$log"; return 1; }
      sleep 1
    done
    echo "[$engine $in-$out] ready after $((SECONDS - started)) s, capacity $(max_concurrency "$log") requests"
  fi
  # the largest level: what our server reported for this shape (both engines run it)
  largest=$(max_concurrency "$OUT_DIR/server.plugin.$in-$out.log" 2> /dev/null)
  largest=$(( ${largest:-$MAX_SEQS} < MAX_SEQS ? ${largest:-$MAX_SEQS} : MAX_SEQS ))
  for c in $CONCURRENCY $largest; do
    local tag="$engine.$in-$out.c$c" poller=
    if [ -z "$DRY_RUN" ]; then
      python scripts/serve_metrics.py poll --port "$PORT" --out "$OUT_DIR/$tag.metrics.json" &
      poller=$!
    fi
    local bench=(vllm bench serve --backend vllm --base-url "http://127.0.0.1:$PORT" --model "$MODEL"
                 --tokenizer "$MODEL" --dataset-name random --random-input-len "$in" --random-output-len "$out"
                 --num-prompts "${PROMPTS:-$(( c * 4 > 8 ? c * 4 : 8 ))}" --max-concurrency "$c" --ignore-eos
                 --num-warmups 2 --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99 --save-result
                 --result-dir "$OUT_DIR" --result-filename "$tag.json" --disable-tqdm)
    if [ -n "$DRY_RUN" ]; then echo "+ ${bench[*]}"; else
      "${bench[@]}" > "$OUT_DIR/$tag.log" 2>&1 || echo "[$tag] bench failed: $(tail -3 "$OUT_DIR/$tag.log")"
    fi
    [ -z "$poller" ] || { kill "$poller"; wait "$poller"; }
  done
  [ -n "$DRY_RUN" ] || { kill -- -"$pid"; wait "$pid"; } 2> /dev/null
}

if [ -z "$REPORT_ONLY" ]; then
  for shape in $SHAPES; do
    for engine in $ENGINES; do serve "$engine" "${shape%:*}" "${shape#*:}"; done
  done
fi
[ -n "$DRY_RUN" ] || python scripts/serve_metrics.py report --model "$MODEL" --card "$CARD" --dir "$OUT_DIR" \
  | tee "$OUT_DIR/report.md"
