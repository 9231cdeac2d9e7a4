#!/usr/bin/env bash
# Optional, and not what a fork that pulls the template's later fixes should do (docs/forking.md): rename the
# package `trainkit` to <new_name> in the code, configs, tests and docs of this git checkout (src/trainkit ->
# src/<new_name>, every whole-word "trainkit" replaced). Afterwards every upstream change to a line that names
# trainkit (an import, a _target_, a docstring) conflicts in `git merge`, and files the template adds land in
# src/trainkit again: a one-way step for a project that leaves the template behind. A fork that keeps merging
# keeps the name; its own package is its rooms (src/trainkit/models, data, tasks) and conf/.
#   scripts/rename_package.sh myproject && make test
set -euo pipefail
new=${1:-}
if [[ ! $new =~ ^[a-z_][a-z0-9_]*$ ]]; then
    echo "error: usage: scripts/rename_package.sh <new_name> (a lowercase Python package name)" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
if [[ ! -d src/trainkit ]]; then
    echo "error: src/trainkit does not exist here (renamed already?)" >&2
    exit 2
fi
git mv src/trainkit "src/$new"
# Not this script: bash reads it while it runs.
git grep -lw trainkit -- . ':!scripts/rename_package.sh' | xargs sed -i "s/\btrainkit\b/$new/g"
rm -rf src/trainkit.egg-info .venv/.installed  # the next make installs the package under its new name
echo "renamed trainkit -> $new ($(git status --short | wc -l) files changed); next: make test"
echo "note: merges of the template's later commits now conflict on every line naming trainkit (docs/forking.md)"
