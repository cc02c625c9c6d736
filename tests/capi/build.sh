#!/usr/bin/env bash
# Prints a directory holding Cluster API's own core manager (`manager`, built
# from the Go module proxy at the version go.mod names: the Cluster, Machine,
# MachineSet, MachineDeployment and MachinePool controllers and the webhooks
# that default, validate and convert their kinds) and its CRDs (`crds/`, the
# module's core/config/crd/bases), building it first if the cache has none
# for these sources (tests/build-go.sh: the cache, its key and its
# installation), and what clusterctl installs it as: `rbac/` (the module's
# core/config/rbac role.yaml, aggregated_role.yaml, service_account.yaml,
# role_binding.yaml and core/config/default's kustomization.yaml and
# manager_role_aggregation_patch.yaml, which name and bind them).
#
#   VOLUME_GATE_HARNESS_CACHE  cache root (default: $HOME/.cache/volume-gate)
set -euo pipefail

name=capi
what="Cluster API's core manager"
binary=manager
also=(crds/cluster.x-k8s.io_clusters.yaml webhook/manifests.yaml rbac/role.yaml)
print=dir

build_into() {
    local version dir
    version="$(go list -m -f '{{.Version}}' sigs.k8s.io/cluster-api)"
    dir="$(go list -m -f '{{.Dir}}' sigs.k8s.io/cluster-api)"
    mkdir -p "$1/crds" "$1/webhook" "$1/rbac"
    cp "$dir"/core/config/crd/bases/*.yaml "$1/crds/"
    cp "$dir/core/config/webhook/manifests.yaml" "$1/webhook/manifests.yaml"
    cp "$dir"/core/config/rbac/{role,aggregated_role,service_account,role_binding}.yaml "$1/rbac/"
    cp "$dir/core/config/default/kustomization.yaml" "$1/rbac/default-kustomization.yaml"
    cp "$dir/core/config/default/manager_role_aggregation_patch.yaml" "$1/rbac/"
    chmod u+w "$1/crds/"*.yaml "$1/webhook/"*.yaml "$1/rbac/"*.yaml
    echo "capi/build.sh: building Cluster API $version's core manager (a cold build takes several minutes)" >&2
    # The version stamp as upstream's Makefile sets it (hack/version.sh:
    # sigs.k8s.io/cluster-api/version.gitVersion).
    CGO_ENABLED=0 go build -trimpath \
        -ldflags="-s -w -X sigs.k8s.io/cluster-api/version.gitVersion=$version" \
        -o "$1/manager" sigs.k8s.io/cluster-api/core >&2
}

source "$(dirname "${BASH_SOURCE[0]}")/../build-go.sh"
