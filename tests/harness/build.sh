#!/usr/bin/env bash
# Prints the absolute path of the control-plane harness binary, building it
# first if the cache holds none for the current sources (tests/build-go.sh:
# the cache, its key and its installation). Upstream kubectl (cmd/kubectl)
# is built beside it, as `kubectl` in the same directory.
#
#   VOLUME_GATE_HARNESS_CACHE  cache root (default: $HOME/.cache/volume-gate)
set -euo pipefail

name=harness
what="the harness"
binary=harness
also=(kubectl)
print=binary

build_into() {
    # Without these the components report v0.0.0-master to clients.
    local kube minor ldflags pkg
    kube="$(go list -m -f '{{.Version}}' k8s.io/kubernetes)"
    minor="${kube#v1.}"
    minor="${minor%%.*}"
    ldflags="-s -w"
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ldflags+=" -X $pkg.gitVersion=$kube -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
    done
    echo "harness/build.sh: building the harness with Kubernetes $kube (a cold build takes several minutes)" >&2
    CGO_ENABLED=0 go build -trimpath -ldflags="$ldflags" -o "$1/harness" . >&2
    CGO_ENABLED=0 go build -trimpath -ldflags="$ldflags" -o "$1/kubectl" ./cmd/kubectl >&2
}

source "$(dirname "${BASH_SOURCE[0]}")/../build-go.sh"
