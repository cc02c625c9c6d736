#!/usr/bin/env bash
# Prints a directory holding the real Flux helm-controller (`helm-controller`,
# built from the Go module proxy at the version go.mod names) and the CRDs it
# needs (`crds/`: HelmRelease from helm-controller's module, ExternalArtifact
# from source-controller's), building it first if the cache has none for
# these sources. Same cache and key scheme as tests/harness/build.sh.
#
#   VOLUME_GATE_HARNESS_CACHE  cache root (default: $HOME/.cache/volume-gate)
set -euo pipefail

# Only its CRDs are taken: helm-controller reads ExternalArtifacts, and the
# tests play the producer that writes their status.
SOURCE_CONTROLLER=v1.9.0

src="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$src"

hash="$(sha256sum build.sh go.mod go.sum | LC_ALL=C sha256sum | cut -c1-16)"
root="${VOLUME_GATE_HARNESS_CACHE:-${HOME:?set HOME or VOLUME_GATE_HARNESS_CACHE}/.cache/volume-gate}"
mkdir -p "$root"
out="$(cd "$root" && pwd)/flux-$hash"

if [[ -x "$out/helm-controller" && -f "$out/crds/externalartifacts.yaml" ]]; then
    echo "$out"
    exit 0
fi

if ! command -v go >/dev/null; then
    echo "flux/build.sh: 'go' is not on PATH; install Go $(sed -n 's/^go //p' go.mod) or newer" >&2
    exit 1
fi
export GOWORK=off

echo "flux/build.sh: downloading Go modules for helm-controller (first run only)" >&2
go mod download >&2
version="$(go list -m -f '{{.Version}}' github.com/fluxcd/helm-controller)"
hc_dir="$(go list -m -f '{{.Dir}}' github.com/fluxcd/helm-controller)"

mkdir -p "$out"
tmp="$(mktemp -d "$out/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/crds"
cp "$hc_dir/config/crd/bases/helm.toolkit.fluxcd.io_helmreleases.yaml" "$tmp/crds/helmreleases.yaml"
# Outside any module: fetched into the module cache and checked against the
# checksum database like any dependency.
sc_dir="$(cd "$tmp" && go mod download -json "github.com/fluxcd/source-controller@$SOURCE_CONTROLLER" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')"
if [[ -z "$sc_dir" ]]; then
    echo "flux/build.sh: cannot download github.com/fluxcd/source-controller@$SOURCE_CONTROLLER" >&2
    exit 1
fi
# helm-controller watches HelmCharts and OCIRepositories too, and waits for
# their kinds before it reconciles anything: all of source-controller's CRDs.
for f in "$sc_dir"/config/crd/bases/source.toolkit.fluxcd.io_*.yaml; do
    cp "$f" "$tmp/crds/${f##*source.toolkit.fluxcd.io_}"
done
chmod u+w "$tmp/crds/"*.yaml

echo "flux/build.sh: building helm-controller $version (a cold build takes several minutes)" >&2
start=$SECONDS
CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o "$tmp/helm-controller" github.com/fluxcd/helm-controller >&2
mv -f "$tmp/crds" "$out/crds.new" && rm -rf "$out/crds" && mv -f "$out/crds.new" "$out/crds"
# rename(2) is atomic: the binary, checked above, lands last.
mv -f "$tmp/helm-controller" "$out/helm-controller"
echo "flux/build.sh: built in $((SECONDS - start)) s" >&2
echo "$out"
