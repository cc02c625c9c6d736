#!/usr/bin/env bash
# Generates (or rotates) the webhook's serving certificate with
# `volume-gate certs generate`, stores it in the TLS Secret the webhook
# mounts, and patches the CA into both webhook configurations.
#
# Idempotent: the first run creates a CA; later runs keep that CA and issue a
# new serving certificate (no caBundle change, no failed admissions while the
# webhook reloads it). NEW_CA=1 replaces the CA too (the caBundle is patched
# before the Secret, so the API server trusts the new CA first).
#
# Environment (defaults in brackets):
#   NAMESPACE [volume-gate]   SERVICE [volume-gate-webhook]
#   SECRET [volume-gate-webhook-tls]   WEBHOOK_CONFIG [volume-gate]
#   CERT_DIR [./volume-gate-certs]  (holds ca.key: keep it safe, or delete it)
#   KUBECTL [kubectl]   VOLUME_GATE [volume-gate]   NEW_CA [0]
#   EXTRA_SANS  space-separated extra DNS names or IPs for the certificate
set -euo pipefail

NAMESPACE="${NAMESPACE:-volume-gate}"
SERVICE="${SERVICE:-volume-gate-webhook}"
SECRET="${SECRET:-volume-gate-webhook-tls}"
WEBHOOK_CONFIG="${WEBHOOK_CONFIG:-volume-gate}"
CERT_DIR="${CERT_DIR:-./volume-gate-certs}"
KUBECTL="${KUBECTL:-kubectl}"
VOLUME_GATE="${VOLUME_GATE:-volume-gate}"
NEW_CA="${NEW_CA:-0}"

say() { printf 'install-certs: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

command -v "$VOLUME_GATE" >/dev/null 2>&1 || [[ -x "$VOLUME_GATE" ]] \
    || die "volume-gate binary not found ($VOLUME_GATE); set VOLUME_GATE=/path/to/volume-gate"
read -r -a kubectl <<<"$KUBECTL"
"${kubectl[@]}" version >/dev/null 2>&1 || die "cannot reach the cluster with '$KUBECTL'; check KUBECONFIG"
"${kubectl[@]}" get namespace "$NAMESPACE" >/dev/null 2>&1 \
    || die "namespace $NAMESPACE does not exist; apply manifests/ first (kubectl apply -k manifests)"

args=(certs generate --service "$SERVICE" --namespace "$NAMESPACE" --out "$CERT_DIR")
for san in ${EXTRA_SANS:-}; do args+=(--san "$san"); done
if [[ "$NEW_CA" != 1 && -s "$CERT_DIR/ca.crt" && -s "$CERT_DIR/ca.key" ]]; then
    say "rotating the serving certificate; keeping the CA in $CERT_DIR"
    args+=(--reuse-ca)
else
    say "generating a new CA and serving certificate in $CERT_DIR"
fi
mkdir -p "$CERT_DIR"
"$VOLUME_GATE" "${args[@]}" >&2
ca_bundle="$(tr -d '\n' <"$CERT_DIR/ca-bundle.b64")"
[[ -n "$ca_bundle" ]] || die "$CERT_DIR/ca-bundle.b64 is empty"

# Trust first, then serve: patch the caBundle before the Secret changes.
patch_ca_bundle() {
    local kind="$1" count i ops=""
    if ! count="$("${kubectl[@]}" get "$kind" "$WEBHOOK_CONFIG" -o jsonpath='{range .webhooks[*]}x{end}' 2>/dev/null)"; then
        die "$kind $WEBHOOK_CONFIG not found; apply manifests/ first"
    fi
    count="${#count}"
    [[ "$count" -gt 0 ]] || die "$kind $WEBHOOK_CONFIG has no webhooks"
    for ((i = 0; i < count; i++)); do
        ops+="${ops:+,}{\"op\":\"add\",\"path\":\"/webhooks/$i/clientConfig/caBundle\",\"value\":\"$ca_bundle\"}"
    done
    "${kubectl[@]}" patch "$kind" "$WEBHOOK_CONFIG" --type=json -p "[$ops]" >/dev/null
    say "caBundle set on $count webhooks of $kind $WEBHOOK_CONFIG"
}
patch_ca_bundle validatingwebhookconfiguration
patch_ca_bundle mutatingwebhookconfiguration

"${kubectl[@]}" -n "$NAMESPACE" create secret tls "$SECRET" \
    --cert="$CERT_DIR/tls.crt" --key="$CERT_DIR/tls.key" --dry-run=client -o yaml \
    | "${kubectl[@]}" apply -f - >/dev/null
say "Secret $NAMESPACE/$SECRET holds the new serving certificate; the webhook reloads it within seconds"
say "done"
