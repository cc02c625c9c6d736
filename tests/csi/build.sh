#!/usr/bin/env bash
# Prints a directory holding Kubernetes' CSI sidecars (`csi-provisioner`,
# `csi-attacher`, built from the Go module proxy at the versions go.mod
# names), building them first if the cache has none for these sources
# (tests/build-go.sh: the cache, its key and its installation).
#
#   VOLUME_GATE_HARNESS_CACHE  cache root (default: $HOME/.cache/volume-gate)
set -euo pipefail

name=csi
what="the CSI sidecars"
binary=csi-provisioner
also=(csi-attacher)
print=dir

build_into() {
    local provisioner attacher
    provisioner="$(go list -m -f '{{.Version}}' github.com/kubernetes-csi/external-provisioner/v6)"
    attacher="$(go list -m -f '{{.Version}}' github.com/kubernetes-csi/external-attacher/v4)"
    echo "csi/build.sh: building external-provisioner $provisioner and external-attacher $attacher (a cold build takes several minutes)" >&2
    CGO_ENABLED=0 go build -trimpath -ldflags="-s -w -X main.version=$provisioner" \
        -o "$1/csi-provisioner" github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner >&2
    CGO_ENABLED=0 go build -trimpath -ldflags="-s -w -X main.version=$attacher" \
        -o "$1/csi-attacher" github.com/kubernetes-csi/external-attacher/v4/cmd/csi-attacher >&2
}

source "$(dirname "${BASH_SOURCE[0]}")/../build-go.sh"
