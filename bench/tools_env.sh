# Sourced on the device by bench/gpu.sh and bench/cpu_device.sh: the tools bundle of
# bench/stage-tools.sh, staged as parts into $TESSPACK (`mkdir -p /root/tesspack && cp .tesspackK/*
# /root/tesspack/`, one call a part). setup_tools unpacks it into $TOOLS once and puts it on the path:
# tesseract, Ghostscript and poppler (its programs find their libraries beside them) and Leptonica
# for chandrad's ctypes load. Its lept/ holds liblept.so.5 alone, so the library path given to the
# daemon's process shadows nothing that vLLM or torch load. Returns 1 when there is no bundle to use.
TOOLS=${TOOLS:-${TESS:-/root/tess}} TESSPACK=${TESSPACK:-/root/tesspack}
setup_tools() {
  if [ ! -x $TOOLS/bin/tesseract ] && ls $TESSPACK/tb.part.* >/dev/null 2>&1; then
    mkdir -p $TOOLS && cat $TESSPACK/tb.part.* | tar xJf - -C $TOOLS || { echo "tools bundle: unpack failed"; return 1; }
  fi
  [ -x $TOOLS/bin/tesseract ] || { echo "tools: none staged (no orientation by tesseract or Leptonica)"; return 1; }
  export PATH=$TOOLS/bin:$PATH LD_LIBRARY_PATH=$TOOLS/lept${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export TESSDATA_PREFIX=$TOOLS/tessdata GS_LIB=$TOOLS/gs/Resource/Init:$TOOLS/gs/lib:$TOOLS/gs/Resource/Font
  export GS_OPTIONS="-sGenericResourceDir=$TOOLS/gs/Resource/ -sICCProfilesDir=$TOOLS/gs/iccprofiles/"
}
