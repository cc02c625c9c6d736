#!/usr/bin/env bash
# Prints a directory holding the real cozystack-controller
# (`cozystack-controller`, built from the Go module proxy at the version
# go.mod names) and the CRDs of every kind its controllers watch (`crds/`:
# ApplicationDefinition, Workload, WorkloadMonitor and TenantGateway from
# Cozystack's module; Gateway, HTTPRoute and TLSRoute from Gateway API's;
# Certificate and Issuer from cert-manager's; BucketClaim from COSI's, each
# at the version Cozystack's go.mod requires), and Cozystack's tenant
# application chart (`charts/tenant`), building it first if the
# cache has none for these sources (tests/build-go.sh). controller-runtime
# stops the whole manager when a watched kind has no CRD.
#
#   VOLUME_GATE_HARNESS_CACHE  cache root (default: $HOME/.cache/volume-gate)
set -euo pipefail

name=cozystack
what=cozystack-controller
binary=cozystack-controller
also=(crds/cozystack.io_applicationdefinitions.yaml charts/tenant/templates/networkpolicy.yaml)
print=dir

build_into() {
    local cozy gateway certmanager cosi version
    cozy="$(go list -m -f '{{.Dir}}' github.com/cozystack/cozystack)"
    version="$(go list -m -f '{{.Version}}' github.com/cozystack/cozystack)"
    gateway="$(go list -m -f '{{.Dir}}' sigs.k8s.io/gateway-api)"
    certmanager="$(go list -m -f '{{.Dir}}' github.com/cert-manager/cert-manager)"
    cosi="$(go list -m -f '{{.Dir}}' sigs.k8s.io/container-object-storage-interface-api)"
    mkdir -p "$1/crds"
    cp "$cozy"/packages/system/application-definition-crd/definition/*.yaml \
        "$cozy"/packages/system/cozystack-controller/definitions/*.yaml \
        "$gateway"/config/crd/experimental/gateway.networking.k8s.io_{gateways,httproutes,tlsroutes}.yaml \
        "$1/crds/"
    # COSI's CRD as Cozystack installs it: with the approval annotation of
    # a protected group, which the module's own file lacks and the API
    # server requires (packages/system/objectstorage-controller/templates/
    # controller.yaml).
    sed '/^  annotations:$/a\    api-approved.kubernetes.io: https://github.com/kubernetes/enhancements/tree/master/keps/sig-storage/1979-object-storage-support' \
        "$cosi"/crds/objectstorage.k8s.io_bucketclaims.yaml >"$1/crds/objectstorage.k8s.io_bucketclaims.yaml"
    # cert-manager ships these as its chart's templates: the labels its
    # chart fills in (the only templated lines outside comments) are left
    # out.
    for kind in certificates issuers; do
        sed -E "/^    [a-z./]+: '\{\{/d" "$certmanager/deploy/crds/crd-$kind.yaml" >"$1/crds/cert-manager.io_$kind.yaml"
        if grep -v '^ *#' "$1/crds/cert-manager.io_$kind.yaml" | grep -q '{{'; then
            echo "cozystack/build.sh: cert-manager's crd-$kind.yaml has template lines left" >&2
            exit 1
        fi
    done
    chmod u+w "$1/crds/"*.yaml
    # Cozystack's tenant application chart, whose network policies decide
    # what reaches a tenant's API server (tests/network.rs renders them).
    # Its library chart is a symlink in the repository, which a module zip
    # leaves out: copied in as the symlink would make it.
    mkdir -p "$1/charts"
    cp -r "$cozy/packages/apps/tenant" "$1/charts/tenant"
    chmod -R u+w "$1/charts/tenant"
    mkdir -p "$1/charts/tenant/charts"
    cp -r "$cozy/packages/library/cozy-lib" "$1/charts/tenant/charts/cozy-lib"
    chmod -R u+w "$1/charts"
    echo "cozystack/build.sh: building cozystack-controller $version (a cold build takes a few minutes)" >&2
    CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o "$1/cozystack-controller" \
        github.com/cozystack/cozystack/cmd/cozystack-controller >&2
}

source "$(dirname "${BASH_SOURCE[0]}")/../build-go.sh"
