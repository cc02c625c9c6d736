#!/usr/bin/env bash
# Prints a directory holding the real `helm` CLI, built from the Go module
# proxy at the version go.mod names (helm.sh/helm/v4), building it first if
# the cache has none for these sources (tests/build-go.sh: the cache, its
# key and its installation).
#
#   VOLUME_GATE_HARNESS_CACHE  cache root (default: $HOME/.cache/volume-gate)
set -euo pipefail

name=helm
what=helm
binary=helm
print=dir

build_into() {
    local version
    version="$(go list -m -f '{{.Version}}' helm.sh/helm/v4)"
    echo "helm/build.sh: building helm $version (a cold build takes a few minutes)" >&2
    # The version is stamped as upstream's Makefile does, so `helm version`
    # and the chart's kubeVersion checks see a real one.
    CGO_ENABLED=0 go build -trimpath \
        -ldflags="-s -w -X helm.sh/helm/v4/internal/version.version=$version" \
        -o "$1/helm" helm.sh/helm/v4/cmd/helm >&2
}

source "$(dirname "${BASH_SOURCE[0]}")/../build-go.sh"
