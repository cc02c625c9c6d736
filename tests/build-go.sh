# The one caching scheme of the Go programs the tests run (the harness,
# Flux's helm-controller, cert-manager, helm). Not run by itself: each
# module's build.sh sets what differs and sources this file, which prints
# the absolute path the tests use (a binary or a directory), building it
# first if the cache holds none for the current sources.
#
# The cache key is the sha256 of this file, the module's build.sh, go.mod,
# go.sum and every *.go file below the module's folder (names and
# contents), so a warm machine pays nothing and any change builds anew.
# The build runs in a scratch directory beside the cache entry and is
# installed by rename(2), the checked binary last: concurrent builders each
# install a complete entry.
#
#   VOLUME_GATE_HARNESS_CACHE  cache root (default: $HOME/.cache/volume-gate)
#
# The sourcing build.sh sets:
#   name      the cache entry's prefix (<root>/<name>-<hash>) and the name
#             in messages ("<name>/build.sh: ...")
#   what      what is built, for messages ("helm-controller")
#   binary    the program the entry holds, relative to the entry; it is
#             installed last, so its presence means the entry is complete
#   also      (array, optional) further paths the entry must hold
#   print     "binary" to print the binary's path, "dir" for the entry's
#   build_into  a function: build_into DIR builds `binary` and `also` into
#             DIR; the module's go.mod is downloaded and GOWORK is off
#             when it runs, with the module's folder as working directory

# The module's folder; every module sits in tests/, beside this file, so the
# key names this file by the same relative path wherever the checkout is.
cd "$(dirname "${BASH_SOURCE[1]}")"

hash="$(find . -name '*.go' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum ../build-go.sh build.sh go.mod go.sum | LC_ALL=C sha256sum | cut -c1-16)"
root="${VOLUME_GATE_HARNESS_CACHE:-${HOME:?set HOME or VOLUME_GATE_HARNESS_CACHE}/.cache/volume-gate}"
mkdir -p "$root"
out="$(cd "$root" && pwd)/$name-$hash"

# Prints what the tests use from the complete entry.
built() {
    case "$print" in
        binary) echo "$out/$binary" ;;
        dir) echo "$out" ;;
        *)
            echo "build-go.sh: print must be 'binary' or 'dir', not '$print'" >&2
            exit 1
            ;;
    esac
}

complete=1
[[ -x "$out/$binary" ]] || complete=0
for path in "${also[@]+"${also[@]}"}"; do
    [[ -e "$out/$path" ]] || complete=0
done
if ((complete)); then
    built
    exit 0
fi

if ! command -v go >/dev/null; then
    echo "$name/build.sh: 'go' is not on PATH; install Go $(sed -n 's/^go //p' go.mod) or newer" >&2
    exit 1
fi

# A go.work further up must not change what gets built.
export GOWORK=off

echo "$name/build.sh: downloading Go modules for $what (first run only)" >&2
go mod download >&2

mkdir -p "$out"
tmp="$(mktemp -d "$out/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
build_into "$tmp"
# rename(2) is atomic: everything else lands first, the binary, checked
# above, last.
for path in "${also[@]+"${also[@]}"}"; do
    top="${path%%/*}"
    [[ -e "$tmp/$top" ]] || continue
    rm -rf "$out/$top.new"
    mv -f "$tmp/$top" "$out/$top.new"
    rm -rf "$out/$top"
    mv -f "$out/$top.new" "$out/$top"
done
mv -f "$tmp/$binary" "$out/$binary"
echo "$name/build.sh: built in $((SECONDS - start)) s" >&2
built
