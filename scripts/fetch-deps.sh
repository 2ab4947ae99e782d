#!/usr/bin/env bash
# Copies what a GPU machine without registries lacks into .deps/ (ignored by git, carried to the
# device): GoogleTest's sources from this machine's Debian package.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps
if [ ! -f .deps/googletest/CMakeLists.txt ]; then
  cp -r /usr/src/googletest .deps/googletest
fi
echo ".deps ready: $(du -sh .deps | cut -f1)"
