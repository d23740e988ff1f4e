#!/usr/bin/env bash
# Device side of the CPU benches (run by the `device` tool's `run`, from the repo root), on the GPU
# machine's cores with the GPU idle: bench/prepare.py --parallel and bench/intake.py (a burst of
# FILES, default 1 000) from the committed snapshot in .bench-carry/src (bench/stage-device.sh),
# chandrad's deps in /root/site (bench/gpu.sh install) and the tools bundle of bench/stage-tools.sh.
#   first, per part: carry [".tesspackK"], `mkdir -p /root/tesspack && cp .tesspackK/* /root/tesspack/`
#   then:            TESS_SETUP=1 bash bench/cpu_device.sh      (carry .whl and .bench-carry)
# Without vLLM staged (one call, carry .tesspack1 .whl .bench-carry; poppler left out of .bench-carry
# to fit 64 MiB: the tools bundle has its own): CPU_ONLY=1 installs .whl (which holds what the image
# lacks for chandrad) and the renderer's wrapper, as bench/gpu.sh install does.
# Results into $OUT: cpu-env.txt, fsync-probe.json, prepare-parallel.json, intake-burst.json,
# intake-daemon-logs.tar.gz. INTAKE_ALSO="DIR ...": more chandrad trees (each holding chandrad/, e.g.
# a variant staged beside .bench-carry/src) for the intake burst, measured in the same run after SRC.
set -uo pipefail
if [ -n "${CPU_ONLY:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /root/site .whl/*.whl || exit 1
  printf '#!/bin/sh\nexec python3 -c "import sys; from chandrad.pdfium_page import cli; sys.exit(cli())" "$@"\n' \
    > /usr/local/bin/chandrad-render-page && chmod +x /usr/local/bin/chandrad-render-page
fi
OUT=${OUT:-/tmp/cpu-out}; mkdir -p "$OUT"
source "$(dirname "$0")/tools_env.sh"
setup_tools || [ -z "${TESS_SETUP:-}" ] || exit 1
export PYTHONUNBUFFERED=1
SRC=$PWD/.bench-carry/src
export PYTHONPATH=$SRC:${SITEDIR:-/root/site}
export CHANDRAD_CORPUS=$PWD/.bench-carry/corpus
{
  cat "$SRC/SOURCE.txt"; echo "cores $(nproc)"; lscpu | grep -E "Model name|^CPU\(s\)"; python3 -V
  tesseract --version 2>&1 | head -2; gs --version; pdftoppm -v 2>&1 | head -1
  python3 -c "from chandrad.scan import leptonica; print('leptonica available:', leptonica.available())"
} 2>&1 | tee "$OUT/cpu-env.txt"
echo "== fsync probe (the disk intake makes claims durable on)"
timeout -k 5 60 python3 bench/fsync_probe.py --json "$OUT/fsync-probe.json" 2>&1 | tail -2
echo "== prepare --parallel"
timeout -k 10 ${PREP_LIMIT:-180} python3 bench/prepare.py --parallel --rounds ${ROUNDS:-10} \
  --json "$OUT/prepare-parallel.json" 2>&1 | tail -25
echo "== intake burst ${FILES:-1000}"
KEEP=/root/intake-keep; rm -rf $KEEP
timeout -k 10 ${INTAKE_LIMIT:-240} python3 bench/intake.py --src "$SRC" $(for d in ${INTAKE_ALSO:-}; do echo --src "$d"; done) --files ${FILES:-1000} \
  --repeat ${REPEAT:-3} --until ${UNTIL:-queued} --out "$OUT/intake-burst.json" --keep $KEEP \
  ${PYSPY:+--spy /root/site/bin/py-spy} 2>&1 | tail -8
# PYSPY=1: each run's daemon recorded by py-spy during the burst (stacks holding the GIL: gil.txt)
(cd $KEEP 2>/dev/null && tar czf "$OUT/intake-daemon-logs.tar.gz" */daemon.log $(ls */gil.txt 2>/dev/null)) 2>/dev/null
true
