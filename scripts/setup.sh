#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian/Ubuntu-like machine: a virtual environment with pydiff
# and its dev tools, and, when no GPU backend opens, Mesa's lavapipe (Vulkan on the CPU).
# Usage: scripts/setup.sh            (called by `make demo` and `make test`)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${PYDIFF_VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.pydiff-setup"

say() { printf 'pydiff setup: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@";
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo "$@";
    else return 1; fi
}

# 1. Python virtual environment ------------------------------------------------------------
command -v "$PY" >/dev/null 2>&1 || die "python3 not found: install Python 3.10 or newer (apt-get install python3 python3-venv)"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "Python 3.10 or newer is needed; $("$PY" --version 2>&1) found"
if [ ! -x "$VENV/bin/python" ]; then
    if ! "$PY" -m venv "$VENV" 2>/dev/null; then
        rm -rf "$VENV"
        say "python3 -m venv failed; installing python3-venv"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null \
            || die "cannot create a virtual environment: install python3-venv (as root: apt-get install python3-venv)"
        "$PY" -m venv "$VENV"
    fi
fi
want="$(cat pyproject.toml | sha1sum | cut -c1-16)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
    say "installing pydiff and its dev tools into $VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    "$VENV/bin/python" -m pip install -q -e ".[dev]" || die "pip install -e .[dev] failed (see above)"
    echo "$want" > "$STAMP"
fi

# 2. A device SlangPy can open -----------------------------------------------------------------
if "$VENV/bin/python" -c "import sys, pydiff.device as d; sys.exit(d.main())" >/dev/null 2>&1; then
    exit 0
fi
say "no CUDA, D3D12 or Vulkan device opens here; installing Mesa's lavapipe (Vulkan on the CPU)"
. /etc/os-release 2>/dev/null || true
manual="Install a Vulkan driver yourself: Mesa 24 or newer (Debian 12: 'apt-get install -t bookworm-backports mesa-vulkan-drivers libvulkan1' after adding bookworm-backports; Ubuntu 24.04+: 'apt-get install mesa-vulkan-drivers libvulkan1'), or a GPU driver."
command -v apt-get >/dev/null 2>&1 || die "this is not a Debian/Ubuntu machine (no apt-get). $manual"
as_root true || die "installing lavapipe needs root (or password-less sudo). $manual"
case "${ID:-}:${VERSION_CODENAME:-}" in
    debian:bookworm)
        # Debian 12's own Mesa (22.3) cannot create a SlangPy device; the backport (25.x) can.
        list=/etc/apt/sources.list.d/pydiff-bookworm-backports.list
        if ! grep -rqs '^[^#]*bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
            echo 'deb http://deb.debian.org/debian bookworm-backports main' | as_root tee "$list" >/dev/null
        fi
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            -t bookworm-backports mesa-vulkan-drivers libvulkan1 >/dev/null ;;
    *)
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            mesa-vulkan-drivers libvulkan1 >/dev/null ;;
esac
"$VENV/bin/python" -c "import sys, pydiff.device as d; sys.exit(d.main())" >&2 \
    || die "lavapipe was installed but no device opens (its Mesa may be too old for SlangPy). $manual"
