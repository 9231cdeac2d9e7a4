#!/usr/bin/env bash
# Wheels of every dependency of trainkit but torch, for a GPU node without internet that has its own torch
# (docs/gpu.md). Run it where pip reaches PyPI, copy DIR to the node, install there with --install.
#
#   bash scripts/wheelhouse.sh PYTHON_VERSION PLATFORM DIR [FREEZE_FILE]
#   bash scripts/wheelhouse.sh --install DIR TARGET        (on the node: PY=<its python>; no network)
#
# PYTHON_VERSION: the node's (3.12). PLATFORM: manylinux_x86_64 (glibc >= 2.28 x86_64: the five manylinux tags
# pip needs, down to manylinux1) or a comma-separated list of pip --platform tags. FREEZE_FILE: the node's
# `pip freeze`; a package it has at a version every requirement accepts is not downloaded.
#
# pip resolves (`pip install --dry-run --report`: the pyproject's dependencies, transitively, wheels only, for that
# Python and platform) and downloads (`pip download --no-deps`); scripts/wheelhouse.py only filters between the
# two: torch, torchvision and what only they need (nvidia-*, triton, sympy, ...) and what the node has are left
# out. Markers (python_version, ...) are pip's host interpreter's, so the resolution runs on python<VERSION> when
# one is found (pyenv's too), else on PY with a warning. trainkit itself needs no wheel: the node runs the repo
# with PYTHONPATH=src.
set -euo pipefail
START=$PWD  # DIR, FREEZE_FILE and TARGET are taken from where the command was given
abs() { if [[ $1 == /* ]]; then printf %s "$1"; else printf %s "$START/$1"; fi; }
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
usage() { sed -n '2,17s/^# \{0,1\}//p' "$0"; }
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    usage
    exit 0
fi

if [[ ${1:-} == --install ]]; then  # the node: no index, no resolution (the wheelhouse is complete for it)
    [[ $# -eq 3 ]] || { usage >&2; exit 2; }
    shopt -s nullglob
    set -- "$1" "$(abs "$2")" "$(abs "$3")"
    wheels=("$2"/*.whl)
    [[ ${#wheels[@]} -gt 0 ]] || { echo "error: no wheels in $2" >&2; exit 2; }
    $PY -m pip install --no-index --no-deps --target "$3" "${wheels[@]}"
    echo "installed ${#wheels[@]} wheels into $3: PYTHONPATH=$3:src $PY src/train.py"
    exit 0
fi

[[ $# -eq 3 || $# -eq 4 ]] || { usage >&2; exit 2; }
VERSION=$1 PLATFORM=$2 DIR=$(abs "$3") FREEZE=${4:+$(abs "$4")}
if [[ $PLATFORM == manylinux_x86_64 ]]; then
    PLATFORM=manylinux_2_28_x86_64,manylinux_2_27_x86_64,manylinux_2_17_x86_64,manylinux2014_x86_64,manylinux1_x86_64
fi
platforms=()
for tag in ${PLATFORM//,/ }; do platforms+=(--platform "$tag"); done
target=(--only-binary=:all: --python-version "$VERSION" --implementation cp "${platforms[@]}")

# The resolving interpreter: the node's version if this machine has one (its markers are then the node's).
RESOLVER=$(command -v "python$VERSION" 2>/dev/null || true)
if [[ -n $RESOLVER ]] && ! "$RESOLVER" -m pip --version > /dev/null 2>&1; then  # e.g. a pyenv shim of no version
    found=("${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$VERSION"*/bin/python)
    RESOLVER=${found[-1]}
fi
[[ -n $RESOLVER ]] && "$RESOLVER" -m pip --version > /dev/null 2>&1 || RESOLVER=""
markers=()
if [[ -z $RESOLVER ]]; then
    RESOLVER=$PY
    markers=(--python-version "$VERSION")
    echo "warning: no python$VERSION here: pip resolves on $($PY -V 2>&1), markers set to $VERSION afterwards" >&2
fi

mkdir -p "$DIR"
work=$(mktemp -d /tmp/wheelhouse.XXXX)
trap 'rm -rf "$work"' EXIT
$PY scripts/wheelhouse.py roots pyproject.toml > "$work/roots.txt"
# --target makes pip accept a foreign --python-version/--platform; --dry-run installs nothing, and the report's
# metadata comes from the index (PEP 658), so torch's several-GB wheel is not fetched.
# A dependency published only as a source archive (hydra-core's antlr4-python3-runtime==4.9.*) has no wheel to
# match: pip builds one here (pure Python: py3-none-any, good on the node) and the resolution is tried again.
target+=(--find-links "$work/built")
for _ in 1 2 3 4 5; do
    if "$RESOLVER" -m pip install --quiet --dry-run --ignore-installed --target "$work/none" "${target[@]}" \
        --report "$work/report.json" -r "$work/roots.txt" 2> "$work/resolve.log"; then
        break
    fi
    sdist=$(sed -n 's/^ERROR: No matching distribution found for //p' "$work/resolve.log")
    if [[ -z $sdist ]]; then
        cat "$work/resolve.log" >&2
        exit 1
    fi
    echo "no wheel of $sdist on the index: building one" >&2
    "$RESOLVER" -m pip wheel --quiet --no-deps -w "$work/built" "$sdist" || exit 1
done
[[ -f $work/report.json ]] || { cat "$work/resolve.log" >&2; exit 1; }
$PY scripts/wheelhouse.py select "$work/report.json" ${FREEZE:+--freeze "$FREEZE"} "${markers[@]}" \
    > "$work/pins.txt" 2> "$work/left_out.txt"
grep -v '^left out' "$work/left_out.txt" >&2 || true
"$RESOLVER" -m pip download --quiet --no-deps "${target[@]}" -d "$DIR" -r "$work/pins.txt" 2> "$work/download.log" ||
    { cat "$work/download.log" >&2; exit 1; }
count=$(wc -l < "$work/pins.txt")
echo "$DIR: $count wheels, $(du -sm "$DIR" | cut -f1) MB, for cp${VERSION/./} ${PLATFORM%%,*}" \
    "($(grep -c '^left out' "$work/left_out.txt") resolved packages left out: torch's or the node's)"
