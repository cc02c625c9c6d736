#!/usr/bin/env bash
# The compiled Rust dependencies of the test build, kept between runs on a
# machine as the Go programs are (tests/build-go.sh), so a fresh clone on a
# machine that has built the tests before compiles only this workspace's
# crates (measured on 2 cores: 101 s instead of 311 s).
#
#   tests/rust-deps-cache.sh restore   before the build: if the target
#                                      directory holds no build yet, copy
#                                      the entry into it
#   tests/rust-deps-cache.sh save      after a successful build: if there
#                                      is no entry yet, make one from the
#                                      target directory, without this
#                                      workspace's own crates
#
#   VOLUME_GATE_HARNESS_CACHE  cache root (default: $HOME/.cache/volume-gate)
#
# An entry is `rust-deps-<key>`: the key is the sha256 of Cargo.lock, every
# Cargo.toml of the workspace, `rustc -vV`, `cargo -V` and the RUSTFLAGS
# variables, so a change to any of them makes a new entry (and the save
# removes the older ones). What the entry holds is Cargo's own: the
# dependencies' artifacts, build-script outputs and fingerprints, copied
# with their times, which Cargo checks as it would in the directory that
# built them; whatever it finds stale or missing it compiles again. The
# workspace's crates are taken out with `cargo clean -p`, so their build
# always starts from this checkout's sources. An entry is written beside
# the others and installed by rename(2): a reader never sees half of one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

action="${1:-}"
case "$action" in
restore | save) ;;
*)
    echo "rust-deps-cache.sh: usage: rust-deps-cache.sh restore|save" >&2
    exit 2
    ;;
esac

metadata="$(cargo metadata --locked --no-deps --format-version 1)"
target="$(sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p' <<<"$metadata")"
if [[ -z "$target" ]]; then
    echo "rust-deps-cache.sh: cargo metadata named no target directory" >&2
    exit 1
fi
# The workspace's packages, as package ID specs (`cargo clean -p` takes them).
mapfile -t packages < <(sed -n 's/.*"workspace_members":\[\([^]]*\)\].*/\1/p' <<<"$metadata" |
    tr ',' '\n' | tr -d '"')
if ((${#packages[@]} == 0)); then
    echo "rust-deps-cache.sh: cargo metadata named no workspace member" >&2
    exit 1
fi
manifests=(Cargo.lock)
while IFS= read -r m; do
    manifests+=("$m")
done < <(grep -o '"manifest_path":"[^"]*"' <<<"$metadata" | sed 's/"manifest_path":"\(.*\)"/\1/' | sort -u)

key="$({
    cat "${manifests[@]}"
    rustc -vV
    cargo -V
    printf 'RUSTFLAGS=%s\nCARGO_ENCODED_RUSTFLAGS=%s\n' "${RUSTFLAGS:-}" "${CARGO_ENCODED_RUSTFLAGS:-}"
} | sha256sum | cut -c1-16)"
root="${VOLUME_GATE_HARNESS_CACHE:-${HOME:?set HOME or VOLUME_GATE_HARNESS_CACHE}/.cache/volume-gate}"
entry="$root/rust-deps-$key"

case "$action" in
restore)
    if [[ -d "$target/debug/.fingerprint" ]]; then
        exit 0 # built here before: Cargo knows what it has
    fi
    if [[ ! -d "$entry" ]]; then
        echo "rust-deps-cache.sh: no compiled dependencies cached for this Cargo.lock and toolchain ($entry): the build compiles them"
        exit 0
    fi
    mkdir -p "$target"
    cp -a "$entry/." "$target/"
    echo "rust-deps-cache.sh: compiled dependencies restored from $entry"
    ;;
save)
    if [[ -d "$entry" ]]; then
        exit 0
    fi
    mkdir -p "$root"
    staging="$(mktemp -d "$root/.rust-deps-$key.XXXXXX")"
    chmod 755 "$staging"
    trap 'rm -rf "$staging"' EXIT
    mkdir "$staging/debug"
    for d in deps build .fingerprint; do
        if [[ -d "$target/debug/$d" ]]; then
            cp -a "$target/debug/$d" "$staging/debug/"
        fi
    done
    cp -a "$target/CACHEDIR.TAG" "$staging/" 2>/dev/null || true
    clean=()
    for p in "${packages[@]}"; do
        clean+=(-p "$p")
    done
    CARGO_TARGET_DIR="$staging" cargo clean --locked --quiet "${clean[@]}"
    if mv -T "$staging" "$entry" 2>/dev/null; then
        trap - EXIT
        echo "rust-deps-cache.sh: compiled dependencies saved in $entry ($(du -sh "$entry" | cut -f1))"
    fi
    # Older entries (another Cargo.lock or toolchain) are not used again.
    for old in "$root"/rust-deps-*; do
        [[ "$old" == "$entry" || ! -d "$old" ]] || rm -rf "$old"
    done
    ;;
esac
