#!/usr/bin/env bash
# Make sure a headless-capable Chromium is at /usr/bin/chromium (for the
# real-browser test of the learner path, tests/browser/). Installs Debian's `chromium`
# package with apt when it is missing; never downloads a browser build of its
# own (Playwright's `playwright install` is not used).
#
# Usage: scripts/ensure_chromium.sh        (root, or sudo available)
# Exit 0 when chromium is there afterwards; non-zero with a message otherwise.
set -euo pipefail

CHROMIUM=/usr/bin/chromium

if [ -x "$CHROMIUM" ]; then
  echo "ensure_chromium: $($CHROMIUM --version 2>/dev/null || echo chromium) is installed"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure_chromium: $CHROMIUM is missing and apt-get is not available;" >&2
  echo "  install Chromium yourself (the browser test is skipped without it)." >&2
  exit 1
fi

SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
  else
    echo "ensure_chromium: not root and no sudo: cannot apt-get install chromium" >&2
    exit 1
  fi
fi

echo "ensure_chromium: installing Debian's chromium package with apt-get"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends chromium fonts-dejavu-core

if [ ! -x "$CHROMIUM" ]; then
  echo "ensure_chromium: apt-get finished but $CHROMIUM is still missing" >&2
  exit 1
fi
echo "ensure_chromium: $($CHROMIUM --version 2>/dev/null || echo chromium) installed"
