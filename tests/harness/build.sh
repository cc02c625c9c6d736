#!/usr/bin/env bash
# Prints the absolute path of the control-plane harness binary, building it
# first if the cache holds none for the current sources. The cache key is the
# sha256 of go.mod, go.sum and every *.go file (names and contents), so a warm
# machine pays nothing and any source change builds a new binary.
#
#   VOLUME_GATE_HARNESS_CACHE  cache root (default: $HOME/.cache/volume-gate)
set -euo pipefail

src="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$src"

hash="$(LC_ALL=C sha256sum go.mod go.sum *.go | sha256sum | cut -c1-16)"
cache="${VOLUME_GATE_HARNESS_CACHE:-${HOME:?set HOME or VOLUME_GATE_HARNESS_CACHE}/.cache/volume-gate}"
mkdir -p "$cache/harness-$hash"
out="$(cd "$cache/harness-$hash" && pwd)"
bin="$out/harness"

if [[ -x "$bin" ]]; then
    echo "$bin"
    exit 0
fi

if ! command -v go >/dev/null; then
    echo "build.sh: 'go' is not on PATH; install Go $(sed -n 's/^go //p' go.mod) or newer" >&2
    exit 1
fi

# A go.work further up must not change what gets built.
export GOWORK=off

echo "build.sh: downloading Go modules for the harness (first run only)" >&2
go mod download >&2

echo "build.sh: building $bin (a cold build takes several minutes)" >&2
tmp="$(mktemp -d "$out/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o "$tmp/harness" . >&2
# rename(2) is atomic: concurrent builders each install a complete binary.
mv -f "$tmp/harness" "$bin"
echo "build.sh: built in $((SECONDS - start)) s" >&2
echo "$bin"
