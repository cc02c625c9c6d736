#!/usr/bin/env bash
# Prints a directory holding Kubernetes' CSI sidecars (`csi-provisioner`,
# `csi-attacher`, `csi-snapshotter` and `snapshot-controller`, built from the
# Go module proxy at the versions go.mod names) and, in crds/, the
# snapshot.storage.k8s.io CRDs of the external-snapshotter client module
# that go.mod names, the one the binaries are compiled against (what
# Cozystack's vsnap-crd chart installs), building them first if the cache has none for these sources
# (tests/build-go.sh: the cache, its key and its installation).
#
#   VOLUME_GATE_HARNESS_CACHE  cache root (default: $HOME/.cache/volume-gate)
set -euo pipefail

name=csi
what="the CSI sidecars"
binary=csi-provisioner
snapshot_crds=(crds/snapshot.storage.k8s.io_volumesnapshotclasses.yaml
    crds/snapshot.storage.k8s.io_volumesnapshotcontents.yaml
    crds/snapshot.storage.k8s.io_volumesnapshots.yaml)
also=(csi-attacher csi-snapshotter snapshot-controller "${snapshot_crds[@]}")
print=dir

build_into() {
    local provisioner attacher snapshotter
    provisioner="$(go list -m -f '{{.Version}}' github.com/kubernetes-csi/external-provisioner/v6)"
    attacher="$(go list -m -f '{{.Version}}' github.com/kubernetes-csi/external-attacher/v4)"
    snapshotter="$(go list -m -f '{{.Version}}' github.com/kubernetes-csi/external-snapshotter/v8)"
    echo "csi/build.sh: building external-provisioner $provisioner, external-attacher $attacher and external-snapshotter $snapshotter (a cold build takes several minutes)" >&2
    CGO_ENABLED=0 go build -trimpath -ldflags="-s -w -X main.version=$provisioner" \
        -o "$1/csi-provisioner" github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner >&2
    CGO_ENABLED=0 go build -trimpath -ldflags="-s -w -X main.version=$attacher" \
        -o "$1/csi-attacher" github.com/kubernetes-csi/external-attacher/v4/cmd/csi-attacher >&2
    CGO_ENABLED=0 go build -trimpath -ldflags="-s -w -X main.version=$snapshotter" \
        -o "$1/csi-snapshotter" github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter >&2
    CGO_ENABLED=0 go build -trimpath -ldflags="-s -w -X main.version=$snapshotter" \
        -o "$1/snapshot-controller" github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller >&2
    local client crd
    client="$(go list -m -f '{{.Dir}}' github.com/kubernetes-csi/external-snapshotter/client/v8)"
    mkdir -p "$1/crds"
    for crd in "${snapshot_crds[@]}"; do
        install -m 0644 "$client/config/crd/${crd#crds/}" "$1/$crd"
    done
}

source "$(dirname "${BASH_SOURCE[0]}")/../build-go.sh"
