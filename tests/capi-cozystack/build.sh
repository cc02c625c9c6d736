#!/usr/bin/env bash
# Prints a directory holding Cluster API's core manager at the version
# Cozystack v1.6.2 runs (packages/system/capi-providers-core/files/
# core-components.yaml: registry.k8s.io/cluster-api/cluster-api-controller:
# v1.10.1), built from the Go module proxy at the version go.mod names, with
# its CRDs (`crds/`, the module's config/crd/bases), its webhook
# configurations (`webhook/manifests.yaml`) and what clusterctl installs it
# as (`rbac/`: config/rbac role.yaml, aggregated_role.yaml,
# service_account.yaml, role_binding.yaml and config/default's
# kustomization.yaml and manager_role_aggregation_patch.yaml). The Cozystack
# world's tenants run on it; tests/capi builds v1.14.2 for the plain Cluster
# API world. The layout is the one tests/capi/build.sh prints; before v1.14
# the manager is the module's root package and its config is config/, not
# core/config/.
#
#   VOLUME_GATE_HARNESS_CACHE  cache root (default: $HOME/.cache/volume-gate)
set -euo pipefail

name=capi-cozystack
what="Cluster API's core manager (Cozystack's version)"
binary=manager
also=(crds/cluster.x-k8s.io_clusters.yaml webhook/manifests.yaml rbac/role.yaml)
print=dir

build_into() {
    local version dir
    version="$(go list -m -f '{{.Version}}' sigs.k8s.io/cluster-api)"
    dir="$(go list -m -f '{{.Dir}}' sigs.k8s.io/cluster-api)"
    mkdir -p "$1/crds" "$1/webhook" "$1/rbac"
    cp "$dir"/config/crd/bases/*.yaml "$1/crds/"
    cp "$dir/config/webhook/manifests.yaml" "$1/webhook/manifests.yaml"
    cp "$dir"/config/rbac/{role,aggregated_role,service_account,role_binding}.yaml "$1/rbac/"
    cp "$dir/config/default/kustomization.yaml" "$1/rbac/default-kustomization.yaml"
    cp "$dir/config/default/manager_role_aggregation_patch.yaml" "$1/rbac/"
    chmod u+w "$1/crds/"*.yaml "$1/webhook/"*.yaml "$1/rbac/"*.yaml
    echo "capi-cozystack/build.sh: building Cluster API $version's core manager (a cold build takes several minutes)" >&2
    # The version stamp as upstream's Makefile sets it (hack/version.sh:
    # sigs.k8s.io/cluster-api/version.gitVersion).
    CGO_ENABLED=0 go build -trimpath \
        -ldflags="-s -w -X sigs.k8s.io/cluster-api/version.gitVersion=$version" \
        -o "$1/manager" sigs.k8s.io/cluster-api >&2
}

source "$(dirname "${BASH_SOURCE[0]}")/../build-go.sh"
