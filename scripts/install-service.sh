#!/usr/bin/env bash
# Install chandrad as a systemd service (run as root; `make install` calls this):
#   - a venv at $PREFIX/venv with chandrad (and vLLM for GPUs: EXTRAS=vllm, the default)
#   - units into /etc/systemd/system, sysusers into /etc/sysusers.d, tmpfiles into /etc/tmpfiles.d
#   - /etc/chandrad/config.toml from config.example.toml, unless one exists (never overwritten)
#   - creates the user and folders (systemd-sysusers, systemd-tmpfiles) and reloads systemd
# DESTDIR=/some/root stages the files there instead (packaging, tests) and touches nothing live.
# Upgrade: pull the new version and run it again, then `systemctl restart chandrad`.
set -euo pipefail
cd "$(dirname "$0")/.."
DESTDIR="${DESTDIR:-}"
PREFIX="${PREFIX:-/opt/chandrad}"
EXTRAS="${EXTRAS-vllm}"
python="${PYTHON:-python3}"

install -d "$DESTDIR/etc/systemd/system" "$DESTDIR/etc/sysusers.d" "$DESTDIR/etc/tmpfiles.d" "$DESTDIR/etc/chandrad"
install -m 0644 systemd/chandrad.service systemd/chandrad@.service "$DESTDIR/etc/systemd/system/"
install -m 0644 systemd/chandrad.sysusers "$DESTDIR/etc/sysusers.d/chandrad.conf"
install -m 0644 systemd/chandrad.tmpfiles "$DESTDIR/etc/tmpfiles.d/chandrad.conf"
if [[ ! -e "$DESTDIR/etc/chandrad/config.toml" ]]; then
    install -m 0644 config.example.toml "$DESTDIR/etc/chandrad/config.toml"
    echo "install-service: wrote $DESTDIR/etc/chandrad/config.toml (edit it, then systemctl reload chandrad)"
fi
if [[ "${SKIP_VENV:-}" != 1 ]]; then
    [[ -x "$DESTDIR$PREFIX/venv/bin/python" ]] || "$python" -m venv "$DESTDIR$PREFIX/venv"
    "$DESTDIR$PREFIX/venv/bin/python" -m pip install -q --upgrade pip
    "$DESTDIR$PREFIX/venv/bin/python" -m pip install -q "$PWD${EXTRAS:+[$EXTRAS]}"
fi
if [[ -z "$DESTDIR" ]]; then
    systemd-sysusers /etc/sysusers.d/chandrad.conf
    systemd-tmpfiles --create /etc/tmpfiles.d/chandrad.conf
    if [[ -d /run/systemd/system ]]; then
        systemctl daemon-reload
        echo "install-service: done. Start it with: systemctl enable --now chandrad"
    else
        echo "install-service: systemd is not running here; units installed but not loaded"
    fi
fi
