#!/usr/bin/env bash
# Prints a directory holding the real `helm` CLI, built from the Go module
# proxy at the version go.mod names (helm.sh/helm/v4), building it first if
# the cache has none for these sources. Same cache and key scheme as
# tests/harness/build.sh and tests/flux/build.sh.
#
#   VOLUME_GATE_HARNESS_CACHE  cache root (default: $HOME/.cache/volume-gate)
set -euo pipefail

src="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$src"

hash="$(sha256sum build.sh go.mod go.sum | LC_ALL=C sha256sum | cut -c1-16)"
root="${VOLUME_GATE_HARNESS_CACHE:-${HOME:?set HOME or VOLUME_GATE_HARNESS_CACHE}/.cache/volume-gate}"
mkdir -p "$root"
out="$(cd "$root" && pwd)/helm-$hash"

if [[ -x "$out/helm" ]]; then
    echo "$out"
    exit 0
fi

if ! command -v go >/dev/null; then
    echo "helm/build.sh: 'go' is not on PATH; install Go $(sed -n 's/^go //p' go.mod) or newer" >&2
    exit 1
fi
export GOWORK=off

echo "helm/build.sh: downloading Go modules for helm (first run only)" >&2
go mod download >&2
version="$(go list -m -f '{{.Version}}' helm.sh/helm/v4)"

mkdir -p "$out"
tmp="$(mktemp -d "$out/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
echo "helm/build.sh: building helm $version (a cold build takes a few minutes)" >&2
start=$SECONDS
# The version is stamped as upstream's Makefile does, so `helm version`
# and the chart's kubeVersion checks see a real one.
CGO_ENABLED=0 go build -trimpath \
    -ldflags="-s -w -X helm.sh/helm/v4/internal/version.version=$version" \
    -o "$tmp/helm" helm.sh/helm/v4/cmd/helm >&2
# rename(2) is atomic: the binary, checked above, lands last.
mv -f "$tmp/helm" "$out/helm"
echo "helm/build.sh: built in $((SECONDS - start)) s" >&2
echo "$out"
