#!/usr/bin/env bash
# bench/peers.py on the GPU machine's 16 cores (the GPU idle): chandrad's CPU path against OCRmyPDF
# where no network is. Staged here first:
#   bash bench/stage-device.sh        .bench-carry (the committed chandrad, the corpus files peers.py
#                                     reads, pdftotext) and .whl (chandrad's deps the image lacks)
#   bash bench/stage-tools.sh         .tesspack1 (tesseract, Ghostscript, poppler, Leptonica)
#   PEERS=1 bash bench/stage-device.sh also fills .peerwhl (OCRmyPDF 17.13 and what it needs, less
#                                     what .whl holds)
# Device, back to back (the machine is given back after 30 s idle):
#   call 1, carry [".whl", ".peerwhl"]:           INSTALL=1 bash bench/peers_device.sh
#   call 2, carry [".tesspack1", ".bench-carry"]: mkdir -p /root/tesspack && cp .tesspack1/* /root/tesspack/ \
#                                                 && bash bench/peers_device.sh --copies 4 --json $OUT/peers.json
# PYSPY=1: py-spy (from .whl, /root/site/bin) records the GIL holder of chandrad's `once` run, as
# collapsed stacks in $OUT/peers-once-gil.txt.gz (its log beside it). It attaches once the process
# has been running a second: found sooner (2026-12-07) it was still taskset, or a python without its
# library mapped yet, and py-spy gave up ("Failed to find python version").
set -uo pipefail
if [ -n "${INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /root/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /root/peers .peerwhl/*.whl || exit 1
  # OCRmyPDF on its own packages first, then chandrad's for the few they share (pikepdf, pypdfium2, pydantic)
  printf '#!/bin/sh\nPYTHONPATH=/root/peers:/root/site exec python3 -m ocrmypdf "$@"\n' > /usr/local/bin/ocrmypdf
  printf '#!/bin/sh\nexec python3 -c "import sys; from chandrad.pdfium_page import cli; sys.exit(cli())" "$@"\n' \
    > /usr/local/bin/chandrad-render-page
  chmod +x /usr/local/bin/ocrmypdf /usr/local/bin/chandrad-render-page
  /usr/local/bin/ocrmypdf --version
  exit
fi
source "$(dirname "$0")/tools_env.sh"
setup_tools || exit 1
cp .bench-carry/bin/pdftotext "$TOOLS/bin/"  # the bundle has pdftoppm and pdfinfo; same libraries
# tesseract's output configs (hocr, txt, pdf), which OCRmyPDF and chandrad name; the bundle has only the models
cp -r .bench-carry/tessdata/. "$TESSDATA_PREFIX/"
export PYTHONPATH=/root/site CHANDRAD_CORPUS=$PWD/.bench-carry/corpus PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
{ cat .bench-carry/src/SOURCE.txt; echo "cores $(nproc)"; tesseract --version 2>&1 | head -1; gs --version; /usr/local/bin/ocrmypdf --version; } 2>&1
if [ -n "${PYSPY:-}" ]; then
  (
    for _ in $(seq 1 1500); do
      pid=$(pgrep -f -- "-m chandrad once" | head -1)
      [ -n "$pid" ] && break
      sleep 0.2
    done
    [ -n "$pid" ] || { echo "no chandrad once process" > "$OUT/peers-once-gil.log"; exit; }
    sleep 1
    /root/site/bin/py-spy record --nonblocking --gil --threads --rate 50 --format raw --pid "$pid" \
      -o "$OUT/peers-once-gil.txt" > "$OUT/peers-once-gil.log" 2>&1
    gzip -f "$OUT/peers-once-gil.txt" 2>/dev/null
  ) &
fi
python3 bench/peers.py --ocrmypdf /usr/local/bin/ocrmypdf "$@"
wait
