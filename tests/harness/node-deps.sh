#!/usr/bin/env bash
# Installs what the management cluster's real node needs (tests/node.rs,
# docs/node.md) from Debian's packages, when some of it is missing: the
# container runtime, runc, the CNI plugins, a static busybox for the images
# the harness assembles, iptables and iproute2. Needs root and apt-get; on a
# machine that has them all it does nothing. `harness up --node` checks the
# rest (cgroups, overlay) and names what is missing.
set -euo pipefail

declare -A package_of=(
    [containerd]=containerd
    [runc]=runc
    [/usr/lib/cni/bridge]=containernetworking-plugins
    [/usr/lib/cni/host-local]=containernetworking-plugins
    [/usr/lib/cni/loopback]=containernetworking-plugins
    [/bin/busybox]=busybox-static
    [iptables]=iptables
    [ip]=iproute2
)
missing=()
for what in "${!package_of[@]}"; do
    if [[ "$what" == /* ]]; then
        [[ -e "$what" ]] && continue
    else
        command -v "$what" >/dev/null && continue
    fi
    missing+=("${package_of[$what]}")
done
((${#missing[@]})) || exit 0
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
if ((EUID != 0)); then
    echo "node-deps.sh: the real node needs the Debian packages ${missing[*]}, and installing them needs root" >&2
    exit 1
fi
echo "node-deps.sh: installing ${missing[*]} (Debian packages, first run only)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
