#!/usr/bin/env bash
# The proxy JupyterHub puts in front of the hub and every learner's server: configurable-http-proxy,
# an npm package, installed into build/node_modules/ (git-ignored), where workshop/jupyterhub_config.py
# looks for it. Idempotent: returns at once when it is there. Needs node and npm (apt-get install npm).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=5.3.0
PROXY=build/node_modules/.bin/configurable-http-proxy
if [ -x "$PROXY" ] && "$PROXY" --version >/dev/null 2>&1; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "workshop/ensure_proxy.sh: npm is missing; install node and npm (apt-get install npm), or configurable-http-proxy yourself" >&2
  exit 1
fi
mkdir -p build
npm install --prefix build --no-audit --no-fund --loglevel=error "configurable-http-proxy@$VERSION"
"$PROXY" --version
