#!/usr/bin/env bash
# Device side of the GPU measurements (run by the `device` tool's `run`, from the repo root).
# Prepare the carried files here first: bench/stage-device.sh (chandrad snapshot, make_model.py,
# poppler bundle, chandrad's pure-Python deps as wheels) and ../shared/device/stage-vllm.sh
# (vLLM 0.26.0 in chunks .vllm-c1..7, one `run` per chunk: mkdir -p /root/stage && cp .vllm-cK/* /root/stage/).
# Carry .bench-carry with its poppler/ for a bench or pair run: without it the pages are dropped as
# PNG, not PDF (setup_poppler), and the figures do not compare with PDF runs (2026-12-07's pair).
# The daemon here finds no tesseract or Leptonica unless they are installed or the tools bundle of
# bench/stage-tools.sh was staged (`mkdir -p /root/tesspack && cp .tesspackK/* /root/tesspack/`, one
# call a part, before `bench` or `pair`; setup_tools): without them pages are not judged for
# orientation, and the daemon's CPU a page is not a real host's.
#
#   bench/gpu.sh install              after the last chunk: install vLLM + wheels into /root/site,
#                                     write the chandra2-like stand-in (make_model.py --full-vocab)
#   bench/gpu.sh bench NAME [opts]    one bench/overhead.py run (bare engine, then the daemon, or both
#                                     at once on two GPUs with --concurrent) on the stand-in with
#                                     load_format=dummy; $OUT/NAME.json, NAME.log, NAME-daemon.log
#   bench/gpu.sh layouts NAME SECONDS "L1 L2 .." [opts]
#                                     the daemon on every GPU once per layout (e.g. "data-parallel
#                                     tensor-parallel encoder-split"), each under its own time limit so
#                                     one that hangs or fails (the error is kept in its JSON) cannot eat
#                                     the call; $OUT/NAME-LAYOUT.json
#   bench/gpu.sh tune NAME SECONDS "COMMON OPTS" LABEL="OPTS" ...
#                                     issue 6's tuning table: per setting, the bare engine (GPU 0) and
#                                     the daemon (GPU 1) at once on the same pages, each setting under
#                                     its own limit (--deadline inside it); $OUT/NAME-LABEL.json and
#                                     one NAME-logs.tar.gz (the call returns at most 8 files)
#   STACKS=SECONDS bench/gpu.sh bench ..  also sample the EngineCores' stacks with py-spy (start profile)
#   bench/gpu.sh soak NAME [opts]     bench/soak_gpu.py: mixed paper sizes, recycle, kill -9, GPU memory
#                                     curve; $OUT/NAME.json, NAME.csv, NAME.log
#   bench/gpu.sh ceilings NAME        bench/profile_gpu.py ceilings: bf16 GEMM TFLOP/s (8192^3 and the
#                                     stand-in's own shapes), copy GB/s, the vision encoder's attention per
#                                     backend at one page's shape; $OUT/NAME.json
#   bench/gpu.sh profile NAME AFTER SECONDS [opts]
#                                     issue 19: on ONE GPU, the daemon run in-process by bench/profiled_daemon.py
#                                     with vLLM's torch profiler (SECONDS of trace once AFTER timed pages are
#                                     done), then the bare engine on the same pages (--phases daemon,bare, one
#                                     compile cache: the second start is warm); the trace is grouped by
#                                     bench/profile_gpu.py while the bare engine runs; $OUT/NAME.json,
#                                     NAME-profile.json (+ .txt), NAME.log, NAME-daemon.log; DELAY=SECONDS
#                                     waits that long after AFTER pages (DELAY=40 with AFTER=1 and one wave of
#                                     192 pages: a decode-only window); the trace itself only if < 15 MB gzipped
#   bench/gpu.sh remote NAME [opts]   issue 20: the daemon with engine.url on a `vllm serve` started with the in-process
#                                     engine's arguments (bench/vllm_server.py), phases remote, remote-kill (SIGKILL of the
#                                     server mid-run, restarted at once), daemon (in-process), serve / stop-server; with
#                                     --keep-server --server-state /root/server.json the server outlives the call (warm for
#                                     the next one); $OUT/NAME.json, NAME.log, NAME-logs.tar.gz (daemons' and server's logs)
#   bench/gpu.sh pair NAME [opts]     one setting, bare vs daemon one after the other on ONE GPU, same pages,
#                                     one compile cache (/root/vcache): $OUT/NAME.json (tune needs two GPUs)
#   bench/gpu.sh save-cache           the compile cache (/root/vcache: vLLM's torch.compile/AOT artefacts and the
#                                     Triton kernels) as $OUT/vcache.tgz.NN parts of 15 MiB, for the next
#                                     session: a machine starts bare, and a cold start costs ~250 s against
#                                     ~75-110 s warm (NOTES-gpu §8-§10). Here, copy the parts into .vcache/
#                                     (ignored); there, before `install`, one call per <= 60 MiB of parts:
#                                     carry [".vcache"], `mkdir -p /root/vcache-parts && cp .vcache/* /root/vcache-parts/`;
#                                     `install` then unpacks them (same vLLM, model and settings = same cache keys)
# The chandrad measured is the working tree that travelled with the call (SRC, committed first).
# Both may be given in one call: bench/gpu.sh install && bench/gpu.sh bench smoke --pages 4 ...
set -uo pipefail
export PYTHONPATH=/root/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
CARRY=$PWD/.bench-carry
MODEL=/root/models/chandra2-like
SRC=${SRC:-$PWD}
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"

install() {
  local t0=$SECONDS
  if [ ! -d /root/site/vllm ]; then
    (cd /root/stage && cat *.part.* > /root/w.tar && mkdir -p /root/whl && tar xf /root/w.tar -C /root/whl \
      && python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site /root/whl/*.whl) \
      || { echo "vLLM install failed"; return 1; }
    rm -f /root/w.tar
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /root/site .whl/*.whl \
    || { echo "wheel install failed"; return 1; }
  # prepare.py renders PDF pages in a child found on PATH (a console script when chandrad is installed)
  printf '#!/bin/sh\nexec python3 -c "import sys; from chandrad.pdfium_page import cli; sys.exit(cli())" "$@"\n' \
    > /usr/local/bin/chandrad-render-page && chmod +x /usr/local/bin/chandrad-render-page
  [ -f $MODEL/config.json ] || python3 $CARRY/make_model.py $MODEL --arch chandra2-like --full-vocab | tail -1
  if [ ! -d /root/vcache ] && ls /root/vcache-parts/vcache.tgz.* >/dev/null 2>&1; then
    cat /root/vcache-parts/vcache.tgz.* | tar xzf - -C /root \
      && echo "compile cache restored: $(du -sm /root/vcache | cut -f1) MiB" || echo "compile cache NOT restored"
  fi
  python3 -c "import vllm, torch, transformers, chandra.output, watchdog, structlog, pdf2image, pydantic_settings; \
print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" || return 1
  (cd $SRC && python3 -m chandrad version) || return 1
  echo "install: $((SECONDS - t0)) s"
}

# The tools bundle (bench/tools_env.sh), where its parts were staged, and whether chandrad finds it
source "$(dirname "$0")/tools_env.sh"
setup_tools_for_daemon() {
  setup_tools || return 0
  (cd $SRC && python3 -c "from chandrad.scan import leptonica; import shutil; \
print('tools: tesseract', shutil.which('tesseract'), '| leptonica available:', leptonica.available())")
}

DROP=png
setup_poppler() {
  if command -v pdftoppm >/dev/null && command -v pdfinfo >/dev/null; then DROP=pdf; echo "poppler: system"; return; fi
  if [ -x $CARRY/poppler/bin/pdftoppm ]; then
    mkdir -p /root/popbin
    for t in pdftoppm pdfinfo; do
      printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$CARRY/poppler/lib" "$CARRY/poppler/bin/$t" > /root/popbin/$t
      chmod +x /root/popbin/$t
    done
    export PATH=/root/popbin:$PATH
    if python3 - <<'PY'
import os, subprocess, tempfile
from PIL import Image
d = tempfile.mkdtemp(); p = os.path.join(d, "t.pdf")
Image.new("RGB", (1632, 2112), "white").save(p, "PDF", resolution=192.0)
subprocess.run(["pdfinfo", p], check=True, capture_output=True)
subprocess.run(["pdftoppm", "-r", "192", "-f", "1", "-l", "1", p, os.path.join(d, "o")], check=True, capture_output=True)
PY
    then DROP=pdf; echo "poppler: carried bundle (Debian 12 pdftoppm/pdfinfo + libs, via wrappers)"; return; fi
  fi
  DROP=png; echo "poppler: none usable -> dropping PNG pages"
}

# STACKS=SECONDS: every 5 s for that long (or until the run ends), py-spy dumps each EngineCore's
# Python stack into $OUT/NAME-stacks.log (inside tune's tarball), to see what vLLM's start does (its "profiling/warmup run" took 74-87 s on
# every start, compile cache warm or not). Needs ptrace; without it the file says why.
sample_stacks() {
  local name=$1 seconds=$2 t=0 pid
  while [ $t -lt "$seconds" ]; do
    # --nonblocking: never pause an engine (the sampler may outlast the start into timed pages)
    for pid in $(pgrep -f '^VLLM::EngineCore'); do
      { echo "=== t=${t}s pid=$pid $(date -u +%T)"; /root/site/bin/py-spy dump --nonblocking --pid "$pid" 2>&1 | head -120; } >> $OUT/$name-stacks.log
    done
    sleep 5; t=$((t + 5))
  done
}

# PYSPY=SECONDS: once the daemon's first page is done, py-spy records its process (every thread,
# without pausing it) for that long, as collapsed stacks in $OUT/NAME-daemon-pyspy-{cpu,gil}.txt
# (on-CPU; holding the GIL): where the daemon's CPU goes during a wave (bench/NOTES-overhead.md).
# Needs ptrace; NAME-daemon-pyspy-{cpu,gil}.log say why if there is no record.
record_daemon() {
  local name=$1 seconds=$2 pid= t=0
  while [ -z "$pid" ] && [ $t -lt 600 ]; do pid=$(pgrep -f -- '-m chandrad run' | head -1); sleep 0.5; t=$((t + 1)); done
  [ -n "$pid" ] || { echo "no chandrad run process" > $OUT/$name-daemon-pyspy-cpu.txt; return; }
  # the engine's start first: the record is of the wave (a page done means the engine answers)
  while ! grep -q '"page done"' /root/work-$name/daemon/daemon.log 2>/dev/null && kill -0 "$pid" 2>/dev/null; do sleep 0.5; done
  local kind flag
  for kind in cpu gil; do
    flag=; [ $kind = gil ] && flag=--gil
    /root/site/bin/py-spy record --nonblocking --threads $flag --rate 50 --format raw --duration "$seconds" \
      --pid "$pid" -o $OUT/$name-daemon-pyspy-$kind.txt > $OUT/$name-daemon-pyspy-$kind.log 2>&1 &
  done
  wait
}

bench() {
  local name=$1; shift
  setup_tools_for_daemon
  setup_poppler
  local sampler= recorder=
  if [ -n "${STACKS:-}" ]; then sample_stacks "$name" "$STACKS" </dev/null >/dev/null 2>&1 & sampler=$!; fi
  if [ -n "${PYSPY:-}" ]; then record_daemon "$name" "$PYSPY" </dev/null >/dev/null 2>&1 & recorder=$!; fi
  nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu,clocks.sm --format=csv
  python3 bench/overhead.py --src $SRC --model $MODEL --arch chandra2-like --gpu --load-format dummy \
    --drop $DROP --engine-arg gdn_prefill_backend=triton --out $OUT/$name.json --workdir /root/work-$name \
    --label "$name" "$@" > $OUT/$name.log 2>&1
  local rc=$?
  [ -n "$sampler" ] && { kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null; }
  [ -n "$recorder" ] && { kill "$recorder" 2>/dev/null; wait "$recorder" 2>/dev/null; }
  cp /root/work-$name/daemon/daemon.log $OUT/$name-daemon.log 2>/dev/null
  grep -E "^\[|^daemon/bare|^micro|pages of|FAILED|Error|error" $OUT/$name.log | grep -v "^RESULT" | tail -40
  tail -c 6000 $OUT/$name.log | grep -E "^RESULT" | cut -c1-4000
  return $rc
}

# After a run cut by its limit: whatever it left behind must not hold the GPUs for the next one.
reap() {
  pkill -9 -f bench/overhead.py 2>/dev/null; pkill -9 -f "chandrad run" 2>/dev/null; pkill -9 -f EngineCore 2>/dev/null
  sleep 5  # the GPUs free their memory
}

layouts() {
  local name=$1 limit=$2 list=$3; shift 3
  local gpus
  gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)
  for layout in $list; do
    echo "== $layout on GPUs $gpus (limit $limit s)"
    timeout -k 20 "$limit" bash "$0" bench "$name-$layout" --phases daemon --daemon-gpus "$gpus" --layout "$layout" \
      --deadline $((limit - 30)) --label "layout comparison: $layout" "$@" || echo "== $layout: exit $? (see $name-$layout.json / .log)"
    reap
  done
}

tune() {
  local name=$1 limit=$2 common=$3; shift 3
  local setting label opts
  for setting in "$@"; do
    label=${setting%%=*}; opts=${setting#*=}
    echo "== $label: $opts (limit $limit s)"
    # shellcheck disable=SC2086  # the options are words on purpose
    timeout -k 20 "$limit" bash "$0" bench "$name-$label" --concurrent --bare-gpu 0 --daemon-gpus 1 \
      --deadline $((limit - 40)) --bare-cache /root/vcache-bare --daemon-cache /root/vcache \
      --label "tuning: $label ($opts)" $common $opts || echo "== $label: exit $?"
    reap
  done
  (cd "$OUT" && tar czf "$name-logs.tar.gz" "$name"-*.log && rm -f "$name"-*.log)
}

soak() {
  local name=$1; shift
  setup_tools_for_daemon
  setup_poppler
  python3 bench/soak_gpu.py --src $SRC --model $MODEL --engine-arg gdn_prefill_backend=triton \
    --workdir /root/work-$name --out $OUT/$name.json --csv $OUT/$name.csv "$@" > $OUT/$name.log 2>&1
  local rc=$?
  cp /root/work-$name/daemon.log $OUT/$name-daemon.log 2>/dev/null
  grep -vE "^\(|INFO|WARNING" $OUT/$name.log | tail -30 | cut -c1-3000
  return $rc
}

ceilings() {
  python3 bench/profile_gpu.py ceilings --out "$OUT/$1.json" 2>&1 | grep -E "^\[ceilings\]|Error|error" | cut -c1-1500
}

pair() {
  local name=$1; shift
  bench "$name" --phases daemon,bare --bare-render --bare-cache /root/vcache --daemon-cache /root/vcache "$@"
}

remote() {
  local name=$1; shift
  bench "$name" --daemon-cache /root/vcache "$@"
  local rc=$?
  # the daemons' logs, and the server's (beside its --server-state file, or in the work folder)
  (cd /root/work-$name && tar czf "$OUT/$name-logs.tar.gz" --ignore-failed-read */daemon.log server/server.log \
    /root/server.log 2>/dev/null)
  return $rc
}

profile() {
  local name=$1 after=$2 seconds=$3 delay=${DELAY:-0}; shift 3
  local dir=/root/prof-$name rec=/root/work-$name/daemon/profile-record.json summ= rc
  rm -rf "$dir" && mkdir -p "$dir"
  pair "$name" --daemon-profile "{\"dir\": \"$dir\", \"after_pages\": $after, \"seconds\": $seconds, \"delay\": $delay}" "$@" &
  local runner=$!
  summarise() {
    python3 bench/profile_gpu.py summarise "$dir" --record "$rec" --out "$OUT/$name-profile.json" \
      > "$OUT/$name-profile.txt" 2>&1
  }
  while kill -0 $runner 2>/dev/null; do
    # The record is written once stop_profile has returned, i.e. once the trace is on disk.
    if [ -z "$summ" ] && [ -f "$rec" ]; then summarise & summ=$!; fi
    sleep 2
  done
  wait $runner; rc=$?
  if [ -n "$summ" ]; then wait "$summ"; elif [ -f "$rec" ]; then summarise; fi
  ls -la "$dir" | tail -5
  cat "$rec" 2>/dev/null | head -40
  cat "$OUT/$name-profile.txt" 2>/dev/null
  # The raw trace comes back only if small (the call returns files of 16 MiB at most).
  for f in "$dir"/*.pt.trace.json*; do
    [ -f "$f" ] || continue
    gzip -1 -c "$f" > "/root/$name-trace.json.gz"
    [ "$(stat -c %s "/root/$name-trace.json.gz")" -lt 15000000 ] && cp "/root/$name-trace.json.gz" "$OUT/"
  done
  return $rc
}

save_cache() {
  [ -d /root/vcache ] || { echo "no /root/vcache to save"; return 1; }
  echo "vcache: $(du -sm /root/vcache | cut -f1) MiB"
  tar cf - -C /root vcache | gzip -1 | split -b 15m -d -a 2 - "$OUT/vcache.tgz."
  ls -la "$OUT"/vcache.tgz.*
  # The call returns 8 files at most: more parts than that cannot all come back.
  [ "$(ls "$OUT"/vcache.tgz.* | wc -l)" -le 8 ] || { echo "more than 8 parts: too large to bring back"; return 1; }
}

cmd=${1:-}; shift || true
case "$cmd" in
  install) install ;;
  bench) bench "$@" ;;
  soak) soak "$@" ;;
  layouts) layouts "$@" ;;
  tune) tune "$@" ;;
  ceilings) ceilings "$@" ;;
  pair) pair "$@" ;;
  save-cache) save_cache ;;
  remote) remote "$@" ;;
  profile) profile "$@" ;;
  *) echo "usage: bench/gpu.sh install | ceilings NAME | profile NAME AFTER SECONDS [options] | pair NAME [options] | bench NAME [overhead.py options] | layouts NAME SECONDS \"LAYOUTS\" [options] | tune NAME SECONDS \"COMMON\" LABEL=\"OPTS\".. | soak NAME [soak_gpu.py options]"; exit 2 ;;
esac
