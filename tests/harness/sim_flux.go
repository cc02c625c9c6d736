package main

import (
	"context"
	"errors"
	"fmt"
	"k8s.io/client-go/dynamic"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"
)

// flux stands in for Flux's helm-controller when a HelmRelease is deleted,
// and for the tenant chart's pre-delete hook (`docs/design.md` §1): a parent
// release runs the hook, in order, with its failure rules; a failed hook
// fails the uninstall, which is retried after an exponential backoff, the
// whole hook again. Any other release (suspended, or not a tenant) is
// uninstalled at once: its Flux finalizer is removed.
type flux struct {
	s  *sim
	rl workqueue.TypedRateLimiter[string]
	q  workqueue.TypedRateLimitingInterface[string]
	// pending holds keys queued, running or waiting out a backoff, so an
	// update to the object never schedules an early retry.
	pending sync.Map
}

const fluxWorkers = 4

func newFlux(s *sim) *flux {
	rl := workqueue.NewTypedItemExponentialFailureRateLimiter[string](s.cfg.retryBase, s.cfg.retryMax)
	return &flux{s: s, rl: rl, q: workqueue.NewTypedRateLimitingQueueWithConfig(rl,
		workqueue.TypedRateLimitingQueueConfig[string]{Name: "flux"})}
}

func inTeardown(hr *unstructured.Unstructured) bool {
	return hr.GetDeletionTimestamp() != nil && slices.Contains(hr.GetFinalizers(), fluxFinalizer)
}

// onUpdate queues a HelmRelease being deleted. A release whose uninstall
// failed waits for its backoff: as with Flux, a change to the object (say,
// an annotation written by the volume-gate worker) does not retry it early.
func (f *flux) onUpdate(hr *unstructured.Unstructured) {
	if !inTeardown(hr) {
		return
	}
	key := hr.GetNamespace() + "/" + hr.GetName()
	// Queued, running or waiting out a backoff: its retry is already set.
	if _, known := f.pending.LoadOrStore(key, struct{}{}); known {
		return
	}
	f.q.Add(key)
}

func (f *flux) run(ctx context.Context) {
	go func() {
		<-ctx.Done()
		f.q.ShutDown()
	}()
	done := make(chan struct{})
	for range fluxWorkers {
		go func() {
			defer func() { done <- struct{}{} }()
			for f.processNext(ctx) {
			}
		}()
	}
	for range fluxWorkers {
		<-done
	}
}

func (f *flux) processNext(ctx context.Context) bool {
	key, quit := f.q.Get()
	if quit {
		return false
	}
	defer f.q.Done(key)
	if err := f.reconcile(ctx, key); err != nil {
		if ctx.Err() != nil {
			return true
		}
		delay := f.rl.When(key) // counts the failure
		ns, name, _ := strings.Cut(key, "/")
		f.s.log.printf("flux", ns+"/"+f.tenantOf(ns, name), "uninstall-failed", "HelmRelease %s: %v; retrying in %s", name, err, delay)
		f.q.AddAfter(key, delay)
		return true
	}
	f.q.Forget(key)
	f.pending.Delete(key)
	return true
}

// tenantOf names the tenant a release belongs to, for the log.
func (f *flux) tenantOf(ns, name string) string {
	if hr, ok, _ := f.s.hrs.get(ns, name); ok {
		if t := hr.GetLabels()[prof.childLabel]; t != "" {
			return t
		}
	}
	return name
}

func (f *flux) reconcile(ctx context.Context, key string) error {
	ns, name, _ := strings.Cut(key, "/")
	client := f.s.dyn.Resource(gvrHelmRelease).Namespace(ns)
	// Read fresh, as helm-controller does before it acts.
	hr, err := client.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if !inTeardown(hr) {
		return nil
	}
	tenant := ns + "/" + f.tenantOf(ns, name)
	suspended, _, _ := unstructured.NestedBool(hr.Object, "spec", "suspend")
	switch {
	case suspended:
		f.s.log.printf("flux", tenant, "uninstall-skipped", "HelmRelease %s is suspended: helm uninstall skipped", name)
	case isParent(hr):
		attempt := f.rl.NumRequeues(key) + 1
		f.s.log.printf("flux", tenant, "uninstall", "HelmRelease %s attempt %d: running the pre-delete hook", name, attempt)
		h := &hookRun{f: f, ns: ns, r: name, tenant: tenant, attempt: attempt}
		if err := h.run(ctx); err != nil {
			return fmt.Errorf("pre-delete hook failed: %w", err)
		}
		if err := h.deleteChartObjects(ctx); err != nil {
			return fmt.Errorf("uninstall: %w", err)
		}
	default:
		f.s.log.printf("flux", tenant, "uninstall", "HelmRelease %s uninstalled", name)
	}
	if _, err := removeFinalizerDynamic(ctx, client, name, hr.GetUID(), fluxFinalizer); err != nil {
		return fmt.Errorf("remove finalizer %s: %w", fluxFinalizer, err)
	}
	f.s.log.printf("flux", tenant, "finalizer-removed", "HelmRelease %s: %s removed", name, fluxFinalizer)
	return nil
}

// hookRun is one run of the pre-delete hook for parent R in namespace N.
type hookRun struct {
	f       *flux
	ns, r   string
	tenant  string
	attempt int
}

func (h *hookRun) logf(step, format string, args ...any) {
	h.f.s.log.printf("hook", h.tenant, step, "attempt=%d "+format, append([]any{h.attempt}, args...)...)
}

// abort is a failure that stops the hook (the shell hook runs under set -e).
func (h *hookRun) abort(step string, err error) error {
	h.logf(step, "FAILED, hook aborted: %v", err)
	return fmt.Errorf("%s: %w", step, err)
}

func (h *hookRun) run(ctx context.Context) error {
	s := h.f.s
	hrs := s.dyn.Resource(gvrHelmRelease).Namespace(h.ns)
	children := metav1.ListOptions{LabelSelector: prof.childLabel + "=" + h.r}

	// Step 1: suspend every child, so Flux skips their uninstall.
	list, err := hrs.List(ctx, children)
	if err != nil {
		return h.abort("step1", fmt.Errorf("list child HelmReleases: %w", err))
	}
	var suspended []string
	for _, c := range list.Items {
		patch := []byte(`{"spec":{"suspend":true}}`)
		if _, err := hrs.Patch(ctx, c.GetName(), types.MergePatchType, patch, metav1.PatchOptions{FieldManager: "flux-client-side-apply"}); err != nil {
			if apierrors.IsNotFound(err) {
				continue
			}
			return h.abort("step1", fmt.Errorf("suspend HelmRelease %s: %w", c.GetName(), err))
		}
		suspended = append(suspended, c.GetName())
	}
	h.logf("step1", "suspended %d child HelmReleases %v", len(suspended), suspended)

	// Step 2: delete the children and wait, bounded; on failure strip
	// their finalizers and carry on.
	if err := h.deleteChildren(ctx); err != nil {
		h.logf("step2", "WARNING %v; force-clearing finalizers of the children left", err)
		left, err := hrs.List(ctx, children)
		if err != nil {
			h.logf("step2", "WARNING list children: %v", err)
		} else {
			for _, c := range left.Items {
				if len(c.GetFinalizers()) == 0 {
					continue
				}
				patch := []byte(`{"metadata":{"finalizers":null}}`)
				if _, err := hrs.Patch(ctx, c.GetName(), types.MergePatchType, patch, metav1.PatchOptions{}); err != nil && !apierrors.IsNotFound(err) {
					h.logf("step2", "WARNING failed to clear finalizers on HelmRelease %s: %v", c.GetName(), err)
				} else {
					h.logf("step2", "force-cleared finalizers on HelmRelease %s", c.GetName())
				}
			}
		}
	}

	// Step 3: delete the KamajiControlPlane; a failure aborts the hook.
	switch err := s.dyn.Resource(gvrKCP).Namespace(h.ns).Delete(ctx, h.r, backgroundDeletion()); {
	case apierrors.IsNotFound(err):
		h.logf("step3", "KamajiControlPlane %s not found", h.r)
	case err != nil:
		return h.abort("step3", fmt.Errorf("delete KamajiControlPlane %s: %w", h.r, err))
	default:
		h.logf("step3", "deleted KamajiControlPlane %s", h.r)
	}

	// Step 4: delete the TenantControlPlane and wait, bounded; a failure
	// only warns.
	tcpGone := h.deleteTCP(ctx)

	// Step 4b: the Kamaji datastore Secret's finalizer, once the TCP is gone.
	h.clearDatastoreFinalizer(ctx, tcpGone)

	// Step 5: DataVolumes (KubeVirt path). An absent CDI is skipped.
	if err := h.deleteDataVolumes(ctx); err != nil {
		return h.abort("step5", err)
	}

	// Step 6: LoadBalancer Services of the cluster.
	if err := h.deleteLoadBalancers(ctx); err != nil {
		return h.abort("step6", err)
	}
	h.logf("done", "cleanup completed successfully")
	return nil
}

func (h *hookRun) deleteChildren(ctx context.Context) error {
	s := h.f.s
	hrs := s.dyn.Resource(gvrHelmRelease).Namespace(h.ns)
	list, err := hrs.List(ctx, metav1.ListOptions{LabelSelector: prof.childLabel + "=" + h.r})
	if err != nil {
		return fmt.Errorf("list child HelmReleases: %w", err)
	}
	var refused []error
	deleted := map[string]types.UID{}
	for _, c := range list.Items {
		err := hrs.Delete(ctx, c.GetName(), backgroundDeletion())
		switch {
		case apierrors.IsNotFound(err):
		case err != nil:
			refused = append(refused, fmt.Errorf("delete HelmRelease %s: %w", c.GetName(), err))
		default:
			deleted[c.GetName()] = c.GetUID()
		}
	}
	names := slices.Sorted(maps.Keys(deleted))
	h.logf("step2", "deleted %d child HelmReleases %v", len(deleted), names)
	if len(refused) > 0 {
		return errors.Join(refused...)
	}
	gone := func() bool {
		for name, uid := range deleted {
			if hr, ok, running := s.hrs.get(h.ns, name); !running || (ok && hr.GetUID() == uid) {
				return false
			}
		}
		return true
	}
	if !waitUntil(ctx, s.cfg.hookTimeout, gone) {
		return fmt.Errorf("child HelmReleases did not go within %s", s.cfg.hookTimeout)
	}
	h.logf("step2", "child HelmReleases gone")
	return nil
}

// deleteTCP deletes the TenantControlPlane and waits for it; it reports
// whether it is gone.
func (h *hookRun) deleteTCP(ctx context.Context) bool {
	s := h.f.s
	tcps := s.dyn.Resource(gvrTCP).Namespace(h.ns)
	tcp, err := tcps.Get(ctx, h.r, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		h.logf("step4", "TenantControlPlane %s not found", h.r)
		return true
	}
	if err == nil {
		err = tcps.Delete(ctx, h.r, backgroundDeletion())
	}
	switch {
	case apierrors.IsNotFound(err):
		h.logf("step4", "TenantControlPlane %s not found", h.r)
		return true
	case err != nil:
		h.logf("step4", "WARNING TenantControlPlane %s not deleted: %v", h.r, err)
		return false
	}
	h.logf("step4", "deleted TenantControlPlane %s; waiting up to %s", h.r, s.cfg.hookTimeout)
	gone := func() bool {
		obj, ok, running := s.tcps.get(h.ns, h.r)
		return running && (!ok || obj.GetUID() != tcp.GetUID())
	}
	if !waitUntil(ctx, s.cfg.hookTimeout, gone) {
		h.logf("step4", "WARNING TenantControlPlane %s did not go within %s", h.r, s.cfg.hookTimeout)
		return false
	}
	h.logf("step4", "TenantControlPlane %s gone", h.r)
	return true
}

func (h *hookRun) clearDatastoreFinalizer(ctx context.Context, tcpGone bool) {
	name := h.r + "-datastore-config"
	if !tcpGone {
		h.logf("step4b", "TenantControlPlane %s still present; leaving Secret %s alone", h.r, name)
		return
	}
	secrets := h.f.s.mgmt.CoreV1().Secrets(h.ns)
	sec, err := secrets.Get(ctx, name, metav1.GetOptions{})
	if err != nil || len(sec.Finalizers) == 0 {
		return
	}
	patch := []byte(`{"metadata":{"finalizers":null}}`)
	if _, err := secrets.Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		h.logf("step4b", "WARNING failed to clear finalizers of Secret %s: %v", name, err)
		return
	}
	h.logf("step4b", "cleared finalizers of Secret %s", name)
}

func (h *hookRun) deleteDataVolumes(ctx context.Context) error {
	s := h.f.s
	served, err := resourceServed(s.disc, gvrDataVolume)
	if err != nil {
		return fmt.Errorf("discover %s: %w", gvrDataVolume.GroupResource(), err)
	}
	if !served {
		h.logf("step5", "DataVolumes not served (CDI not installed): skipped")
		return nil
	}
	dvs := s.dyn.Resource(gvrDataVolume).Namespace(h.ns)
	list, err := dvs.List(ctx, metav1.ListOptions{LabelSelector: prof.clusterLabel + "=" + h.r})
	if err != nil {
		return fmt.Errorf("list DataVolumes: %w", err)
	}
	var names []string
	for _, dv := range list.Items {
		if err := dvs.Delete(ctx, dv.GetName(), backgroundDeletion()); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete DataVolume %s: %w", dv.GetName(), err)
		}
		names = append(names, dv.GetName())
	}
	h.logf("step5", "deleted %d DataVolumes %v", len(names), names)
	return nil
}

func (h *hookRun) deleteLoadBalancers(ctx context.Context) error {
	svcs := h.f.s.mgmt.CoreV1().Services(h.ns)
	list, err := svcs.List(ctx, metav1.ListOptions{LabelSelector: prof.clusterLabel + "=" + h.r})
	if err != nil {
		return fmt.Errorf("list Services: %w", err)
	}
	var names []string
	for _, svc := range list.Items {
		if svc.Spec.Type != corev1.ServiceTypeLoadBalancer {
			continue
		}
		if err := svcs.Delete(ctx, svc.Name, backgroundDeletion()); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete Service %s: %w", svc.Name, err)
		}
		names = append(names, svc.Name)
	}
	h.logf("step6", "deleted %d LoadBalancer Services %v", len(names), names)
	return nil
}

// chartKinds are the kinds of the parent chart's own objects that helm
// uninstall deletes here (the ones Flux labels with the release name),
// among them the KubeVirt CSI controller and its identity.
var chartKinds = []schema.GroupVersionResource{
	{Group: "apps", Version: "v1", Resource: "deployments"},
	{Version: "v1", Resource: "services"},
	{Version: "v1", Resource: "configmaps"},
	{Version: "v1", Resource: "secrets"},
	{Version: "v1", Resource: "serviceaccounts"},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "roles"},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "rolebindings"},
}

// chartClusterKinds are its cluster-scoped objects, labelled with the
// release's name and namespace.
var chartClusterKinds = []schema.GroupVersionResource{
	{Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "clusterroles"},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "clusterrolebindings"},
}

// deleteChartObjects is helm uninstall proper, after the hook succeeded.
func (h *hookRun) deleteChartObjects(ctx context.Context) error {
	var errs []error
	var deleted []string
	type scoped struct {
		gvr        schema.GroupVersionResource
		namespaced bool
	}
	var kinds []scoped
	for _, gvr := range chartKinds {
		kinds = append(kinds, scoped{gvr, true})
	}
	for _, gvr := range chartClusterKinds {
		kinds = append(kinds, scoped{gvr, false})
	}
	for _, k := range kinds {
		gvr := k.gvr
		var c dynamic.ResourceInterface = h.f.s.dyn.Resource(gvr)
		selector := prof.fluxNameLabel + "=" + h.r
		if k.namespaced {
			c = h.f.s.dyn.Resource(gvr).Namespace(h.ns)
		} else {
			selector += "," + prof.fluxNamespaceLabel + "=" + h.ns
		}
		list, err := c.List(ctx, metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			errs = append(errs, fmt.Errorf("list %s: %w", gvr.Resource, err))
			continue
		}
		for _, o := range list.Items {
			if err := c.Delete(ctx, o.GetName(), backgroundDeletion()); err != nil && !apierrors.IsNotFound(err) {
				errs = append(errs, fmt.Errorf("delete %s %s: %w", gvr.Resource, o.GetName(), err))
				continue
			}
			deleted = append(deleted, gvr.Resource+"/"+o.GetName())
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("uninstallation completed with %d error(s): %w", len(errs), errors.Join(errs...))
	}
	h.f.s.log.printf("flux", h.tenant, "uninstalled", "HelmRelease %s: deleted chart objects %v", h.r, deleted)
	return nil
}

// waitUntil checks cond (an informer-cache lookup, so cheap) until it holds
// or timeout passes.
func waitUntil(ctx context.Context, timeout time.Duration, cond func() bool) bool {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for {
		if cond() {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-deadline.C:
			return cond()
		case <-tick.C:
		}
	}
}
