#!/usr/bin/env bash
# Prints a directory holding a cut-down cert-manager built from the Go module
# proxy at the version go.mod names (github.com/cert-manager/cert-manager),
# building it first if the cache has none for these sources
# (tests/build-go.sh: the cache, its key and its installation):
#
#   <dir>/cert-manager   one binary, subcommands `controller` and `cainjector`
#                        (see main.go for what each runs and its flags)
#   <dir>/crds/*.yaml    the CRDs of that version (deploy/crds of the module)
#
#   VOLUME_GATE_HARNESS_CACHE  cache root (default: $HOME/.cache/volume-gate)
set -euo pipefail

name=certmanager
what=cert-manager
binary=cert-manager
also=(crds)
print=dir

build_into() {
    local version moddir
    version="$(go list -m -f '{{.Version}}' github.com/cert-manager/cert-manager)"
    moddir="$(go list -m -f '{{.Dir}}' github.com/cert-manager/cert-manager)"
    echo "certmanager/build.sh: building cert-manager $version (a cold build takes several minutes)" >&2
    # The version is stamped as upstream's Makefile does; it shows in the
    # User-Agent and so in the field managers of the objects it writes.
    CGO_ENABLED=0 go build -trimpath \
        -ldflags="-s -w -X github.com/cert-manager/cert-manager/pkg/util.AppVersion=$version" \
        -o "$1/cert-manager" . >&2
    mkdir -p "$1/crds"
    cp "$moddir"/deploy/crds/*.yaml "$1/crds/"
    chmod -R u+w "$1/crds" # the module cache is read-only
}

source "$(dirname "${BASH_SOURCE[0]}")/../build-go.sh"
