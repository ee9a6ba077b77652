#!/usr/bin/env bash
# A source tree as a commit had it, rebuilt where there is no git (the GPU machine gets a copy of the
# working tree without .git): `prepare` runs here and stores REF's version of every file that differs
# from the working tree in .base-tree/ (git-ignored, carried to the GPU machine); `build` runs there
# and writes the working tree with those files put back, to time a change against what it replaces in
# one lease (`scripts/option_trials.sh MODEL OUT '' 'tree=DEST'`, or a kernel benchmark's --against
# with DEST's copy of the kernel's module).
#
# usage: scripts/base_tree.sh prepare REF     (here: REF is any commit, e.g. HEAD or main~2)
#        scripts/base_tree.sh build DEST      (there: DEST is created or emptied first)
# Files that REF lacks (new in the working tree) are left out of DEST; files REF has and the working
# tree lacks are restored. Untracked files travel as they are. Exit 2 for bad usage.
set -euo pipefail
cd "$(dirname "$0")/.."
store=.base-tree
usage() { echo "usage: scripts/base_tree.sh prepare REF | build DEST" >&2; exit 2; }
[ $# -eq 2 ] || usage
case $1 in
  prepare)
    ref=$2
    git rev-parse --verify --quiet "$ref^{commit}" >/dev/null || { echo "error: $ref is not a commit" >&2; exit 2; }
    rm -rf "$store" && mkdir -p "$store/files"
    git rev-parse "$ref" >"$store/ref.txt"
    : >"$store/absent.txt"
    git diff --name-only --no-renames "$ref" -- | while IFS= read -r path; do
      if git cat-file -e "$ref:$path" 2>/dev/null; then
        mkdir -p "$store/files/$(dirname "$path")"
        git show "$ref:$path" >"$store/files/$path"
      else
        echo "$path" >>"$store/absent.txt"
      fi
    done
    echo "stored $(find "$store/files" -type f | wc -l) files of $(cut -c1-12 "$store/ref.txt") ($(wc -l <"$store/absent.txt") new since) in $store/"
    ;;
  build)
    dest=$2
    [ -f "$store/ref.txt" ] || { echo "error: no $store/ref.txt: run 'scripts/base_tree.sh prepare REF' first (and carry $store)" >&2; exit 2; }
    case $(realpath -m "$dest") in
      "$(pwd)" | "$(pwd)"/* | /) echo "error: $dest is this tree or inside it" >&2; exit 2 ;;
    esac
    rm -rf "$dest" && mkdir -p "$dest"
    tar --exclude=./.git --exclude="./$store" --exclude=./.vllm-stage --exclude=./perf-out --exclude=./bench-out \
      -cf - . | tar -xf - -C "$dest"
    cp -R "$store/files/." "$dest/"
    while IFS= read -r path; do [ -n "$path" ] && rm -f "$dest/$path"; done <"$store/absent.txt"
    echo "built $dest as of $(cut -c1-12 "$store/ref.txt")"
    ;;
  *) usage ;;
esac
