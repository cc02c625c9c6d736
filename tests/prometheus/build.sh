#!/usr/bin/env bash
# Prints the path of Prometheus' `promtool`, built from the Go module proxy at
# the version go.mod names (github.com/prometheus/prometheus v0.316.0, which
# is Prometheus 3.16.0: the VERSION file of that module version), building it
# first if the cache has none for these sources (tests/build-go.sh: the
# cache, its key and its installation). tests/alerts.rs runs it: `promtool
# check rules` and `promtool test rules` on the chart's rendered alerts.
#
#   VOLUME_GATE_HARNESS_CACHE  cache root (default: $HOME/.cache/volume-gate)
set -euo pipefail

name=prometheus
what=promtool
binary=promtool
print=binary

build_into() {
    local version release
    version="$(go list -m -f '{{.Version}}' github.com/prometheus/prometheus)"
    release="$(cat "$(go list -m -f '{{.Dir}}' github.com/prometheus/prometheus)/VERSION")"
    echo "prometheus/build.sh: building promtool $release (module $version; a cold build takes several minutes)" >&2
    # Tags and version stamp as upstream's .promu.yml builds it (netgo,
    # builtinassets; github.com/prometheus/common/version.Version), so
    # `promtool --version` names the release.
    CGO_ENABLED=0 go build -trimpath -tags netgo,builtinassets \
        -ldflags="-s -w -X github.com/prometheus/common/version.Version=$release" \
        -o "$1/promtool" github.com/prometheus/prometheus/cmd/promtool >&2
}

source "$(dirname "${BASH_SOURCE[0]}")/../build-go.sh"
