package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	authzv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// kcsiIdentity is the KubeVirt CSI controller's own identity in the
// management cluster: ServiceAccount R-kcsi and its Role, RoleBinding,
// ClusterRole and ClusterRoleBinding, templates of the parent release (not
// of R-csi). The controller frees a disk by deleting its DataVolume as that
// identity, so here the simulated driver frees a volume only while a
// SelfSubjectAccessReview made with that ServiceAccount's token allows it:
// a Helm uninstall that deleted the identity leaves the driver running and
// unable to free anything, as in Cozystack.
type kcsiIdentity struct {
	mu        sync.Mutex
	token     string
	tokenAt   time.Time
	allowed   bool
	reason    string
	checkedAt time.Time
	// logged is the last reason logged for not being able to free a
	// volume or snapshot, so each reason is logged once. Guarded by
	// loggedMu (CSI calls are served concurrently).
	loggedMu sync.Mutex
	logged   string
}

// noteRefusal reports whether why is a new reason to log (and records it);
// an empty why clears the last one.
func (k *kcsiIdentity) noteRefusal(why string) bool {
	k.loggedMu.Lock()
	defer k.loggedMu.Unlock()
	if why == k.logged {
		return false
	}
	k.logged = why
	return why != ""
}

// kcsiCheckTTL bounds how stale a verdict on the identity may be.
const kcsiCheckTTL = 2 * time.Second

// kcsiNeeds is what the controller does as its identity to free a volume.
func kcsiNeeds(ns string) []authzv1.ResourceAttributes {
	return []authzv1.ResourceAttributes{
		{Namespace: ns, Verb: "delete", Group: "cdi.kubevirt.io", Resource: "datavolumes"},
		{Verb: "get", Resource: "persistentvolumes"},
	}
}

// kcsiAllowed reports whether the tenant's CSI controller identity may free
// a volume now, and why not.
func (t *tenant) kcsiAllowed(ctx context.Context) (bool, string) {
	k := &t.kcsi
	k.mu.Lock()
	defer k.mu.Unlock()
	if time.Since(k.checkedAt) < kcsiCheckTTL {
		return k.allowed, k.reason
	}
	k.allowed, k.reason = t.checkKcsi(ctx, k)
	k.checkedAt = time.Now()
	return k.allowed, k.reason
}

// kcsiTokenTTL and kcsiTokenRefresh follow a projected ServiceAccount
// token: requested for an hour, refreshed at 80% of it. A refresh that
// fails (a terminating namespace takes no TokenRequest) leaves the token
// in use until it expires, as the kubelet leaves it in the Pod.
const (
	kcsiTokenTTL     = time.Hour
	kcsiTokenRefresh = 48 * time.Minute
)

// tokenLocked is the ServiceAccount's token, requested as the kubelet
// requests a projected one and refreshed likewise; k.mu is held.
func (t *tenant) tokenLocked(ctx context.Context, k *kcsiIdentity) (string, error) {
	sa := t.kcsiServiceAccount()
	if k.token == "" || time.Since(k.tokenAt) > kcsiTokenRefresh {
		exp := int64(kcsiTokenTTL / time.Second)
		tr, err := t.s.mgmt.CoreV1().ServiceAccounts(t.ns).CreateToken(ctx, sa,
			&authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{ExpirationSeconds: &exp}}, metav1.CreateOptions{})
		switch {
		case err == nil:
			k.token, k.tokenAt = tr.Status.Token, time.Now()
		case k.token != "" && time.Since(k.tokenAt) < kcsiTokenTTL-time.Minute:
			// Keep using the token the controller already holds.
		default:
			k.token = ""
			return "", fmt.Errorf("no token for ServiceAccount %s/%s: %v", t.ns, sa, err)
		}
	}
	return k.token, nil
}

// kcsiConfig is a management client configuration acting as the CSI
// controller's identity (the token a Pod of R-kcsi-controller holds).
func (t *tenant) kcsiConfig(ctx context.Context) (*rest.Config, error) {
	k := &t.kcsi
	k.mu.Lock()
	defer k.mu.Unlock()
	return t.kcsiConfigLocked(ctx, k)
}

// kcsiConfigLocked is kcsiConfig with k.mu held.
func (t *tenant) kcsiConfigLocked(ctx context.Context, k *kcsiIdentity) (*rest.Config, error) {
	token, err := t.tokenLocked(ctx, k)
	if err != nil {
		return nil, err
	}
	cfg := rest.AnonymousClientConfig(t.s.restCfg)
	cfg.BearerToken = token
	return cfg, nil
}

func (t *tenant) checkKcsi(ctx context.Context, k *kcsiIdentity) (bool, string) {
	sa := t.kcsiServiceAccount()
	cfg, err := t.kcsiConfigLocked(ctx, k)
	if err != nil {
		return false, err.Error()
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return false, err.Error()
	}
	for _, ra := range kcsiNeeds(t.ns) {
		review := &authzv1.SelfSubjectAccessReview{Spec: authzv1.SelfSubjectAccessReviewSpec{ResourceAttributes: &ra}}
		r, err := cs.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, review, metav1.CreateOptions{})
		if err != nil {
			// A token of a deleted ServiceAccount is refused: ask for a new one next time.
			k.token = ""
			return false, fmt.Sprintf("as ServiceAccount %s/%s: %v", t.ns, sa, err)
		}
		if !r.Status.Allowed {
			return false, fmt.Sprintf("ServiceAccount %s/%s may not %s %s.%s", t.ns, sa, ra.Verb, ra.Resource, ra.Group)
		}
	}
	return true, ""
}

// mayFree is the identity check before a DeleteVolume or DeleteSnapshot
// (what): an error (logged once per reason) while the controller's
// identity may not free a disk.
func (t *tenant) mayFree(ctx context.Context, what, id string) error {
	ok, why := t.kcsiAllowed(ctx)
	if ok {
		t.kcsi.noteRefusal("")
		return nil
	}
	if t.kcsi.noteRefusal(why) {
		t.logf("driver", "identity-missing", "cannot free %s: %s", id, why)
	}
	return fmt.Errorf("%s %s: the CSI controller's identity: %s", what, id, why)
}

// kcsiServiceAccount is the CSI controller's ServiceAccount: R-kcsi, or
// the one a played Cluster API cluster's management-side controller runs
// as (sim_capi.go).
func (t *tenant) kcsiServiceAccount() string {
	if m := t.managementCSI(); m != nil {
		return m.serviceAccount
	}
	return t.name + "-kcsi"
}

// diskLabels are the labels the CSI controller puts on its DataVolumes
// (its --infra-cluster-labels): the profile's infra labels for R, or a
// management-side Cluster API controller's own.
func (t *tenant) diskLabels() map[string]string {
	if m := t.managementCSI(); m != nil {
		return m.labels
	}
	return infraLabels(t.name)
}

// owner names the tenant whose driver provisions the claim: this one.
func (t *tenant) owner(*corev1.PersistentVolumeClaim) (string, string) { return t.ns, t.name }
