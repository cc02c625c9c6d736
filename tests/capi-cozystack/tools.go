//go:build tools

// The manager this module builds (tests/capi-cozystack/build.sh); the import
// keeps its requirements in go.mod and go.sum through `go mod tidy`.
package tools

import _ "sigs.k8s.io/cluster-api"
