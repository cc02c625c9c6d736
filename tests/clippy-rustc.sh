#!/bin/sh
# Cargo's RUSTC_WORKSPACE_WRAPPER for tests/suite.sh: compiles each crate of
# the workspace with clippy-driver, which is rustc with Clippy's lints
# added (the way `cargo clippy` runs it, but through code generation, not
# only checking), warnings denied. So the suite's one build both lints and
# builds: the lints of `cargo clippy --workspace --all-targets -- -D
# warnings`, over the same targets, without compiling every dependency a
# second time for a check. Dependencies are compiled by plain rustc.
#
# Cargo runs it as: clippy-rustc.sh /path/to/rustc ARGS...
# The clippy-driver beside that rustc is of the same toolchain.
set -eu
driver="$(dirname "$1")/clippy-driver"
if [ ! -x "$driver" ]; then
    driver="$(command -v clippy-driver || true)"
fi
if [ -z "$driver" ]; then
    echo "tests/clippy-rustc.sh: no clippy-driver beside $1 or on PATH: the suite lints as it builds; install Clippy (rustup component add clippy)" >&2
    exit 2
fi
exec "$driver" "$@" -D warnings
