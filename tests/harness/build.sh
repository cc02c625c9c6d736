#!/usr/bin/env bash
# Prints the absolute path of the control-plane harness binary, building it
# first if the cache holds none for the current sources. The cache key is the
# sha256 of build.sh, go.mod, go.sum and every *.go file below this folder
# (names and contents), so a warm machine pays nothing and any change builds
# a new binary.
#
#   VOLUME_GATE_HARNESS_CACHE  cache root (default: $HOME/.cache/volume-gate)
set -euo pipefail

src="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$src"

hash="$(find . -name '*.go' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum build.sh go.mod go.sum | LC_ALL=C sha256sum | cut -c1-16)"
root="${VOLUME_GATE_HARNESS_CACHE:-${HOME:?set HOME or VOLUME_GATE_HARNESS_CACHE}/.cache/volume-gate}"
mkdir -p "$root"
out="$(cd "$root" && pwd)/harness-$hash"
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

# Without these the components report v0.0.0-master to clients.
kube="$(go list -m -f '{{.Version}}' k8s.io/kubernetes)"
minor="${kube#v1.}"
minor="${minor%%.*}"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$kube -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
done

echo "build.sh: building $bin with Kubernetes $kube (a cold build takes several minutes)" >&2
mkdir -p "$out"
tmp="$(mktemp -d "$out/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
CGO_ENABLED=0 go build -trimpath -ldflags="$ldflags" -o "$tmp/harness" . >&2
# rename(2) is atomic: concurrent builders each install a complete binary.
mv -f "$tmp/harness" "$bin"
echo "build.sh: built in $((SECONDS - start)) s" >&2
echo "$bin"
