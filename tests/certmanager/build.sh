#!/usr/bin/env bash
# Prints a directory holding a cut-down cert-manager built from the Go module
# proxy at the version go.mod names (github.com/cert-manager/cert-manager),
# building it first if the cache has none for these sources:
#
#   <dir>/cert-manager   one binary, subcommands `controller` and `cainjector`
#                        (see main.go for what each runs and its flags)
#   <dir>/crds/*.yaml    the CRDs of that version (deploy/crds of the module)
#
# Same cache and key scheme as tests/harness/build.sh and tests/helm/build.sh.
#
#   VOLUME_GATE_HARNESS_CACHE  cache root (default: $HOME/.cache/volume-gate)
set -euo pipefail

src="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$src"

hash="$(find . -name '*.go' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum build.sh go.mod go.sum | LC_ALL=C sha256sum | cut -c1-16)"
root="${VOLUME_GATE_HARNESS_CACHE:-${HOME:?set HOME or VOLUME_GATE_HARNESS_CACHE}/.cache/volume-gate}"
mkdir -p "$root"
out="$(cd "$root" && pwd)/certmanager-$hash"

if [[ -x "$out/cert-manager" ]]; then
    echo "$out"
    exit 0
fi

if ! command -v go >/dev/null; then
    echo "certmanager/build.sh: 'go' is not on PATH; install Go $(sed -n 's/^go //p' go.mod) or newer" >&2
    exit 1
fi
# A go.work further up must not change what gets built.
export GOWORK=off

echo "certmanager/build.sh: downloading Go modules for cert-manager (first run only)" >&2
go mod download >&2
version="$(go list -m -f '{{.Version}}' github.com/cert-manager/cert-manager)"
moddir="$(go list -m -f '{{.Dir}}' github.com/cert-manager/cert-manager)"

mkdir -p "$out"
tmp="$(mktemp -d "$out/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
echo "certmanager/build.sh: building cert-manager $version (a cold build takes several minutes)" >&2
start=$SECONDS
# The version is stamped as upstream's Makefile does; it shows in the
# User-Agent and so in the field managers of the objects it writes.
CGO_ENABLED=0 go build -trimpath \
    -ldflags="-s -w -X github.com/cert-manager/cert-manager/pkg/util.AppVersion=$version" \
    -o "$tmp/cert-manager" . >&2
mkdir -p "$tmp/crds"
cp "$moddir"/deploy/crds/*.yaml "$tmp/crds/"
chmod -R u+w "$tmp/crds" # the module cache is read-only
# rename(2) is atomic: the CRDs land first, the binary, checked above, last.
rm -rf "$out/crds"
mv -f "$tmp/crds" "$out/crds"
mv -f "$tmp/cert-manager" "$out/cert-manager"
echo "certmanager/build.sh: built in $((SECONDS - start)) s" >&2
echo "$out"
