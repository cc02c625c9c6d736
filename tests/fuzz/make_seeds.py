#!/usr/bin/env python3
"""Writes the seed corpus under tests/fuzz/corpus/<target>/ (small files).

Run from anywhere: python3 tests/fuzz/make_seeds.py. The admission seeds are
one facts-length byte (0: default facts) followed by the AdmissionReview body.
"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
P = "volumes.cozystack.io/"
PARENT_LABELS = {"apps.cozystack.io/application.kind": "Kubernetes",
                 "apps.cozystack.io/application.group": "apps.cozystack.io"}
FIN = "volumes.cozystack.io/release"


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def obj(kind, api, name, ns="tenant-x", labels=None, annotations=None, finalizers=None, deleting=False):
    meta = {"name": name, "namespace": ns}
    if labels is not None:
        meta["labels"] = labels
    if annotations is not None:
        meta["annotations"] = annotations
    if finalizers is not None:
        meta["finalizers"] = finalizers
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"apiVersion": api, "kind": kind, "metadata": meta}


def review(op, group, version, kind, resource, name, old=None, new=None, user="alice", uid="u-1", ns="tenant-x"):
    req = {"uid": uid,
           "kind": {"group": group, "version": version, "kind": kind},
           "resource": {"group": group, "version": version, "resource": resource},
           "name": name, "namespace": ns, "operation": op,
           "userInfo": {"username": user, "groups": ["system:authenticated"]}}
    if old is not None:
        req["oldObject"] = old
    if new is not None:
        req["object"] = new
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


HR = ("helm.toolkit.fluxcd.io", "v2", "HelmRelease", "helmreleases")
HRAPI = "helm.toolkit.fluxcd.io/v2"


def hr(name, **kw):
    return obj("HelmRelease", HRAPI, name, **kw)


def admission_seeds():
    s = {}
    parent = hr("kubernetes-a", labels=PARENT_LABELS, finalizers=[FIN])
    s["parent-update-override"] = review("UPDATE", *HR, "kubernetes-a", old=parent,
        new=hr("kubernetes-a", labels=PARENT_LABELS, finalizers=[FIN],
               annotations={P + "override": "tenant abandoned, disks gone with the cluster"}))
    s["parent-update-override-stamped-now"] = review("UPDATE", *HR, "kubernetes-a", old=parent,
        new=hr("kubernetes-a", labels=PARENT_LABELS, finalizers=[FIN],
               annotations={P + "override": "abandoned", P + "override-by": "alice", P + "override-at": "@NOW@"}))
    s["parent-update-withdraw"] = review("UPDATE", *HR, "kubernetes-a",
        old=hr("kubernetes-a", labels=PARENT_LABELS, finalizers=[FIN],
               annotations={P + "override": "x", P + "override-by": "alice", P + "override-at": "2026-01-01T00:00:00Z"}),
        new=hr("kubernetes-a", labels=PARENT_LABELS, finalizers=[FIN],
               annotations={P + "override-by": "alice", P + "override-at": "2026-01-01T00:00:00Z"}))
    s["parent-update-forge-record"] = review("UPDATE", *HR, "kubernetes-a", old=parent,
        new=hr("kubernetes-a", labels=PARENT_LABELS, finalizers=[FIN], annotations={P + "phase": "Released"}))
    s["parent-update-drop-finalizer"] = review("UPDATE", *HR, "kubernetes-a", old=parent,
        new=hr("kubernetes-a", labels=PARENT_LABELS, finalizers=[]))
    s["parent-update-by-worker"] = review("UPDATE", *HR, "kubernetes-a", old=parent,
        new=hr("kubernetes-a", labels=PARENT_LABELS, finalizers=[FIN],
               annotations={P + "phase": "Releasing", P + "message": "0/2 volumes freed",
                            P + "volumes": json.dumps({"taken_at": "2026-01-01T00:00:00Z", "total": 2, "freed": 0,
                                "volumes": [{"pv": "pvc-1", "driver": "csi.kubevirt.io", "handle": "vol-1",
                                             "capacity": "10Gi", "reclaim": "Delete", "claim": "default/data-0"}]})}),
        user="system:serviceaccount:volume-gate:volume-gate-worker")
    s["parent-create"] = review("CREATE", *HR, "kubernetes-b", new=hr("kubernetes-b", labels=PARENT_LABELS))
    s["parent-create-null-finalizers"] = review("CREATE", *HR, "kubernetes-b",
        new={"apiVersion": HRAPI, "kind": "HelmRelease",
             "metadata": {"name": "kubernetes-b", "namespace": "tenant-x", "labels": PARENT_LABELS,
                          "finalizers": None, "annotations": {P + "override": "x"}}})
    s["parent-delete-in-custody"] = review("DELETE", *HR, "kubernetes-a", old=parent)
    s["parent-delete-no-custody"] = review("DELETE", *HR, "kubernetes-a", old=hr("kubernetes-a", labels=PARENT_LABELS))
    s["parent-delete-released"] = review("DELETE", *HR, "kubernetes-a",
        old=hr("kubernetes-a", labels=PARENT_LABELS, annotations={P + "phase": "Released"}))
    child_labels = {"cozystack.io/target-cluster-name": "kubernetes-a"}
    s["child-delete"] = review("DELETE", *HR, "kubernetes-a-cilium", old=hr("kubernetes-a-cilium", labels=child_labels))
    s["csi-delete"] = review("DELETE", *HR, "kubernetes-a-csi", old=hr("kubernetes-a-csi", labels=child_labels))
    s["csi-delete-unlabelled"] = review("DELETE", *HR, "kubernetes-a-csi", old=hr("kubernetes-a-csi"))
    s["child-relabel"] = review("UPDATE", *HR, "kubernetes-a-cilium", old=hr("kubernetes-a-cilium", labels=child_labels),
        new=hr("kubernetes-a-cilium", labels={}))
    s["csi-relabel"] = review("UPDATE", *HR, "kubernetes-a-csi", old=hr("kubernetes-a-csi", labels=child_labels),
        new=hr("kubernetes-a-csi", labels={"cozystack.io/target-cluster-name": "kubernetes-z"}))
    both = dict(child_labels); both.update(PARENT_LABELS)
    s["csi-relabel-to-parent"] = review("UPDATE", *HR, "kubernetes-a-csi", old=hr("kubernetes-a-csi", labels=child_labels),
        new=hr("kubernetes-a-csi", labels=both))
    s["csi-as-parent-delete"] = review("DELETE", *HR, "kubernetes-a-csi",
        old=hr("kubernetes-a-csi", labels=both, finalizers=[FIN]))
    s["secret-delete"] = review("DELETE", "", "v1", "Secret", "secrets", "kubernetes-a-admin-kubeconfig",
        old=obj("Secret", "v1", "kubernetes-a-admin-kubeconfig"))
    s["machine-delete"] = review("DELETE", "cluster.x-k8s.io", "v1beta1", "Machine", "machines", "kubernetes-a-md0-x1",
        old=obj("Machine", "cluster.x-k8s.io/v1beta1", "kubernetes-a-md0-x1",
                labels={"cluster.x-k8s.io/cluster-name": "kubernetes-a"}))
    s["kamaji-delete"] = review("DELETE", "kamaji.clastix.io", "v1alpha1", "TenantControlPlane", "tenantcontrolplanes",
        "kubernetes-a", old=obj("TenantControlPlane", "kamaji.clastix.io/v1alpha1", "kubernetes-a"))
    s["kcsi-delete"] = review("DELETE", "apps", "v1", "Deployment", "deployments", "kubernetes-a-kcsi-controller",
        old=obj("Deployment", "apps/v1", "kubernetes-a-kcsi-controller"))
    s["unrelated-delete"] = review("DELETE", "", "v1", "ConfigMap", "configmaps", "cm", old=obj("ConfigMap", "v1", "cm"))
    s["delete-without-old"] = review("DELETE", *HR, "kubernetes-a-csi")
    bodies = {k: json.dumps(v, separators=(",", ":")) for k, v in s.items()}
    # Malformed ones.
    bodies["truncated"] = bodies["child-delete"][: len(bodies["child-delete"]) // 2]
    v1b = dict(s["child-delete"]); v1b["apiVersion"] = "admission.k8s.io/v1beta1"
    bodies["v1beta1"] = json.dumps(v1b)
    nouid = json.loads(bodies["csi-delete"]); del nouid["request"]["uid"]
    bodies["no-uid"] = json.dumps(nouid)
    badop = json.loads(bodies["csi-delete"]); badop["request"]["operation"] = "EXPLODE"
    bodies["bad-operation"] = json.dumps(badop)
    bodies["null-request"] = '{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":null}'
    bodies["not-json"] = "\x00\x01{"
    for name, body in bodies.items():
        for target in ("admission_review", "admission_http"):
            write(target, name, b"\x00" + body.encode())
    # F5 step 1 through the HTTP target: facts = parent present, not
    # deleting, namespace live.
    write("admission_http", "known-f5-step1-relabel-live-tenant",
          b"\x0b\xff\xff\xff\xff\x00\x00\x00\x00\x00\x00\x90" + bodies["csi-relabel-to-parent"].encode())
    # A few with facts bytes in front (length, then bytes for `arbitrary`).
    # Known finding F1: the worker drops the parent labels and sets an
    # override in one write (facts byte 1: the requester is the worker).
    f1 = review("UPDATE", *HR, "kubernetes-a",
        old=hr("kubernetes-a", labels=PARENT_LABELS, finalizers=[FIN]),
        new=hr("kubernetes-a", labels={}, finalizers=[FIN], annotations={P + "override": "abandoned"}),
        user="system:serviceaccount:volume-gate:volume-gate-worker")
    write("admission_review", "known-f1-worker-unlabel-override", b"\x01\x01" + json.dumps(f1).encode())
    # Known finding F7: invalid UTF-8 in a field the typed model ignores.
    f7 = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "u-f7",
        "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
        "resource": {"group": "", "version": "v1", "resource": "configmaps"},
        "name": "cm", "namespace": "tenant-x", "operation": "DELETE", "userInfo": {"username": "alice"},
        "oldObject": {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}}, "x": "XX"}})
    for target in ("admission_review", "admission_http"):
        write(target, "known-f7-minimal", b"\x00" + f7.encode().replace(b"XX", b"\xff\xfe"))
    write("admission_review", "child-delete-facts", b"\x04\x01\x02\x01\x00" + bodies["child-delete"].encode())
    write("admission_http", "child-delete-facts", b"\x04\x03\x00\x02\x00" + bodies["child-delete"].encode())


def record_seeds():
    # The record target reads structured input through `arbitrary`: any
    # bytes are an input; these few give it different shapes to start from.
    write("record", "empty", b"")
    write("record", "zeros", b"\x00" * 64)
    write("record", "ones", b"\x01" * 64)
    write("record", "phase-released", b"\x01\x00\x00\x00" + b"Released" + b"\x02" * 32)
    write("record", "ascii", b"volumes.cozystack.io/phase=Released;override=x;override-by=alice" * 2)
    write("record", "big-repeat", b"\x05\x04\x03\x02\x01" * 40 + b"\xff\xff\xff\xff" * 8)


PROFILE = """\
name: cozystack
annotationPrefix: volumes.cozystack.io/
custodyFinalizer: volumes.cozystack.io/release
parent:
  group: helm.toolkit.fluxcd.io
  version: v2
  kind: HelmRelease
  plural: helmreleases
  matchLabels:
    apps.cozystack.io/application.kind: Kubernetes
    apps.cozystack.io/application.group: apps.cozystack.io
childLabel: cozystack.io/target-cluster-name
csiRelease: "{tenant}-csi"
kubeconfig:
  secretName: "{tenant}-admin-kubeconfig"
  keys: [super-admin.svc, super-admin.conf]
guarded:
- {role: "the tenant's control plane", group: controlplane.cluster.x-k8s.io, kind: KamajiControlPlane, name: "{tenant}"}
- {role: "the tenant's API server", group: kamaji.clastix.io, kind: TenantControlPlane, name: "{tenant}"}
- {role: "the tenant's Cluster API cluster", group: cluster.x-k8s.io, kind: Cluster, name: "{tenant}"}
- {role: "the tenant's Cluster API cluster", group: cluster.x-k8s.io, kind: Cluster, label: cluster.x-k8s.io/cluster-name}
- {role: "the tenant's worker machines", group: cluster.x-k8s.io, kind: MachineDeployment, label: cluster.x-k8s.io/cluster-name}
- {role: "the tenant's worker machines", group: cluster.x-k8s.io, kind: Machine, label: cluster.x-k8s.io/cluster-name}
- {role: "the tenant's admin kubeconfig", kind: Secret, name: "{tenant}-admin-kubeconfig"}
- {role: "the tenant's CSI controller", group: apps, kind: Deployment, name: "{tenant}-kcsi-controller"}
overridePermission: {group: volumes.cozystack.io, resource: tenants, verb: override}
"""


def profile_seeds():
    write("profile", "cozystack.yaml", PROFILE)
    write("profile", "empty-map.yaml", "{}\n")
    write("profile", "partial.yaml", "name: acme\nchildLabel: acme.io/cluster\ncsiRelease: \"{tenant}-storage\"\n")
    write("profile", "readme-example.yaml",
          "name: acme\nannotationPrefix: volumes.acme.io/\ncsiRelease: \"{tenant}-storage\"\n"
          "kubeconfig:\n  secretName: \"{tenant}-kubeconfig\"\n  keys: [admin.conf]\n")
    write("profile", "bad-guarded.yaml", "guarded:\n- role: x\n  kind: Secret\n")
    write("profile", "unknown-field.yaml", "childLable: x\n")
    write("profile", "anchors.yaml", "a: &a [x, x]\nname: *a\n")
    # Known finding F2: accepted, but the CSI release it names is never recognised.
    write("profile", "known-f2-two-placeholders.yaml", 'csiRelease: "{tenant}-{tenant}-csi"\n')


GOOD_KC = """\
apiVersion: v1
kind: Config
clusters:
- name: kubernetes-a
  cluster:
    server: https://kubernetes-a.tenant-x.svc:6443
    certificate-authority-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCk1JSUJkekNDQVIyZ0F3SUJBZ0lCQURBS0JnZ3Foa2pPUFFRREFqQWpNU0V3SHdZRFZRUUREQmhyTTNNdApjMlZ5ZG1WeUxXTmhRREUzTURBd01EQXdNREF3SGhjTk1qUXdNVEF4TURBd01EQXdXaGNOTXpRd01UQXhNREF3Ck1EQXdXakFqTVNFd0h3WURWUVFEREJock0zTXRjMlZ5ZG1WeUxXTmhRREUzTURBd01EQXdNREF3V1RBVEJnY3EKLS0tLS1FTkQgQ0VSVElGSUNBVEUtLS0tLQo=
users:
- name: kubernetes-a-admin
  user:
    token: eyJhbGciOiJSUzI1NiIsImtpZCI6InNlY3JldC10b2tlbi12YWx1ZSJ9.c2VjcmV0
contexts:
- name: kubernetes-a
  context: {cluster: kubernetes-a, user: kubernetes-a-admin}
current-context: kubernetes-a
"""


def kubeconfig_seeds():
    write("kubeconfig", "good-token", GOOD_KC)
    write("kubeconfig", "good-client-cert", GOOD_KC.replace(
        "    token: eyJhbGciOiJSUzI1NiIsImtpZCI6InNlY3JldC10b2tlbi12YWx1ZSJ9.c2VjcmV0",
        "    client-certificate-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg==\n"
        "    client-key-data: LS0tLS1CRUdJTiBFQyBQUklWQVRFIEtFWS0tLS0tCg=="))
    write("kubeconfig", "exec", GOOD_KC.replace(
        "    token: eyJhbGciOiJSUzI1NiIsImtpZCI6InNlY3JldC10b2tlbi12YWx1ZSJ9.c2VjcmV0",
        "    exec: {apiVersion: client.authentication.k8s.io/v1, command: /bin/sh, args: [-c, id]}"))
    write("kubeconfig", "auth-provider", GOOD_KC.replace(
        "    token: eyJhbGciOiJSUzI1NiIsImtpZCI6InNlY3JldC10b2tlbi12YWx1ZSJ9.c2VjcmV0",
        "    auth-provider: {name: gcp, config: {cmd-path: /bin/sh, access-token: secret-access-token-value}}"))
    write("kubeconfig", "token-file", GOOD_KC.replace(
        "    token: eyJhbGciOiJSUzI1NiIsImtpZCI6InNlY3JldC10b2tlbi12YWx1ZSJ9.c2VjcmV0",
        "    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token"))
    write("kubeconfig", "insecure", GOOD_KC.replace("    certificate-authority-data:", "    insecure-skip-tls-verify: true\n    x:"))
    write("kubeconfig", "ca-file", GOOD_KC.replace("certificate-authority-data: LS0t", "certificate-authority: /etc/ca.crt\n    x: LS0t"))
    write("kubeconfig", "http", GOOD_KC.replace("https://", "http://"))
    write("kubeconfig", "proxy", GOOD_KC.replace("    server:", "    proxy-url: socks5://1.2.3.4:1080\n    server:"))
    write("kubeconfig", "two-docs", GOOD_KC + "---\n" + GOOD_KC.replace("https://", "http://").replace("kubernetes-a", "other"))
    write("kubeconfig", "empty", "apiVersion: v1\nkind: Config\n")
    write("kubeconfig", "garbage-secret", "apiVersion: [unclosed secret-token-value-0123456789")
    write("kubeconfig", "bad-base64-ca", GOOD_KC.replace("certificate-authority-data: LS0t", "certificate-authority-data: ~~~secret-ca-data-0123456789"))
    write("kubeconfig", "bad-token-type", GOOD_KC.replace("    token: ", "    token:\n      - "))
    # Known finding F4 (VG_FUZZ_STRICT_ECHO=1): the cluster name is echoed.
    write("kubeconfig", "known-f4-name-echo", GOOD_KC.replace("https://", "http://").replace(
        "- name: kubernetes-a\n  cluster:", "- name: pasted-TOKEN-eyJhbGciOiJSUzI1NiJ9\n  cluster:"))
    write("kubeconfig", "no-current-context", GOOD_KC.replace("current-context: kubernetes-a\n", ""))


if __name__ == "__main__":
    admission_seeds()
    record_seeds()
    profile_seeds()
    kubeconfig_seeds()
