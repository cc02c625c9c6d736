#!/usr/bin/env bash
# Prints a directory holding the real Flux helm-controller (`helm-controller`,
# built from the Go module proxy at the version go.mod names) and the CRDs it
# needs (`crds/`: HelmRelease from helm-controller's module, ExternalArtifact
# from source-controller's), building it first if the cache has none for
# these sources (tests/build-go.sh: the cache, its key and its installation).
#
#   VOLUME_GATE_HARNESS_CACHE  cache root (default: $HOME/.cache/volume-gate)
set -euo pipefail

# Only its CRDs are taken: helm-controller reads ExternalArtifacts, and the
# tests play the producer that writes their status.
SOURCE_CONTROLLER=v1.9.0

name=flux
what=helm-controller
binary=helm-controller
also=(crds/externalartifacts.yaml)
print=dir

build_into() {
    local version hc_dir sc_dir f
    version="$(go list -m -f '{{.Version}}' github.com/fluxcd/helm-controller)"
    hc_dir="$(go list -m -f '{{.Dir}}' github.com/fluxcd/helm-controller)"
    mkdir -p "$1/crds"
    cp "$hc_dir/config/crd/bases/helm.toolkit.fluxcd.io_helmreleases.yaml" "$1/crds/helmreleases.yaml"
    # Outside any module: fetched into the module cache and checked against
    # the checksum database like any dependency.
    sc_dir="$(cd "$1" && go mod download -json "github.com/fluxcd/source-controller@$SOURCE_CONTROLLER" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')"
    if [[ -z "$sc_dir" ]]; then
        echo "flux/build.sh: cannot download github.com/fluxcd/source-controller@$SOURCE_CONTROLLER" >&2
        exit 1
    fi
    # helm-controller watches HelmCharts and OCIRepositories too, and waits
    # for their kinds before it reconciles anything: all of
    # source-controller's CRDs.
    for f in "$sc_dir"/config/crd/bases/source.toolkit.fluxcd.io_*.yaml; do
        cp "$f" "$1/crds/${f##*source.toolkit.fluxcd.io_}"
    done
    chmod u+w "$1/crds/"*.yaml
    echo "flux/build.sh: building helm-controller $version (a cold build takes several minutes)" >&2
    CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o "$1/helm-controller" github.com/fluxcd/helm-controller >&2
}

source "$(dirname "${BASH_SOURCE[0]}")/../build-go.sh"
