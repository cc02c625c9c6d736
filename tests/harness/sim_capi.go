package main

// The Cluster API world's played providers, behind Cluster API's provider
// contract (v1beta2), next to Cluster API's own core manager (which the
// tests run, tests/capi/build.sh): an infrastructure provider
// (infrastructure.cluster.x-k8s.io/v1alpha1 HarnessCluster, HarnessMachine,
// HarnessMachineTemplate) and a control plane provider
// (controlplane.cluster.x-k8s.io/v1alpha1 HarnessControlPlane), whose CRDs
// are tests/fixtures/crds/capi. What each writes, and where Cluster API
// v1.14.2 reads it:
//
//   - HarnessControlPlane: the harness cluster named by its annotation
//     harness.volume-gate.test/cluster is the tenant's API server. It writes
//     the Secret <cluster>-kubeconfig (key `value`, type
//     cluster.x-k8s.io/secret, labelled cluster.x-k8s.io/cluster-name: what
//     util/secret/consts.go and core/setup/setup.go read) and
//     status.initialization.controlPlaneInitialized
//     (internal/contract/controlplane.go Initialized). Deleted, it stops that
//     cluster through the control API, then drops its finalizer, as Kamaji
//     does (sim_kamaji.go).
//   - HarnessCluster: spec.controlPlaneEndpoint, the tenant API server's
//     host and port, and status.initialization.provisioned
//     (internal/contract/infrastructure_cluster.go).
//   - HarnessMachine: spec.providerID and status.initialization.provisioned
//     (internal/contract/infrastructure_machine.go). The tenant's simulated
//     kubelet (sim_kubelet.go) reports the same spec.providerID on its Node,
//     by which Cluster API's Machine controller finds the Node
//     (core/reconcilers/machine/machine_controller_noderef.go). The node
//     runs while one HarnessMachine of the cluster is not being deleted;
//     when the last is deleted the node dies (its kubelet stops: no
//     heartbeats, nothing finishes its Pods) and then its finalizer goes,
//     as a VM's deletion takes its node down.
//
// The tenant's CSI driver is, by default, the in-tenant shape: its
// controller runs on the tenant's worker node, so it lives while that node
// does, with its disks in the storage ledger (no infra layer). A
// HarnessCluster annotated harness.volume-gate.test/csi-controller: <name>
// runs it management-side instead, as kubevirt-csi-driver's split
// deployment does (github.com/kubevirt/csi-driver, commit 27b52aa,
// README.md "Split deployment", deploy/controller-infra/base/deploy.yaml):
// the controller is the Deployment <name> in the Cluster's namespace and
// lives while it does (not being deleted), whatever the machines; it makes
// one DataVolume per volume there, labelled with what its csi-driver
// container passes as --infra-cluster-labels, and frees one by deleting it
// as the ServiceAccount its Pods run as (sim_kcsi.go, sim_infra.go: the
// Cozystack KubeVirt path's backend), only while that identity may. Its
// node plugin still runs on the cluster's node. This needs the simulator's
// infra layer (CDI, KubeVirt, the management storage). The names here are
// Cluster API's contract's, the played providers' and the Deployment's,
// not the profile's: the world does not depend on volume-gate's
// configuration.
//
// A Cluster is played only if its spec.controlPlaneRef is a
// HarnessControlPlane: Clusters of other control planes (Cozystack's
// KamajiControlPlane) are not this file's.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/ptr"
)

const (
	// capiClusterNameLabel: Cluster API labels what belongs to a Cluster
	// with its name (the Cluster controller labels its control plane and
	// infrastructure objects, core/reconcilers/cluster/
	// cluster_controller_phases.go ensureOwnerRefAndLabel; a MachineSet its
	// Machines' infrastructure, machineset_controller.go).
	capiClusterNameLabel = "cluster.x-k8s.io/cluster-name"
	// capiKubeconfigSuffix and capiKubeconfigKey: the Secret
	// <cluster>-kubeconfig and its key (util/secret/consts.go
	// KubeconfigDataName), which Cluster API's cluster cache reads.
	capiKubeconfigSuffix = "-kubeconfig"
	capiKubeconfigKey    = "value"
	// capiSecretType is ClusterSecretType (module sigs.k8s.io/cluster-api/api
	// v1.14.2, core/v1beta2/common_types.go).
	capiSecretType = "cluster.x-k8s.io/secret"

	// annCSIController on a HarnessCluster names the Deployment of the
	// cluster's management-side CSI controller, in its namespace.
	annCSIController = "harness.volume-gate.test/csi-controller"
	// infraClusterLabelsFlag is kubevirt-csi-driver's flag for the labels
	// of its DataVolumes, 'name=value' pairs separated by commas
	// (cmd/kubevirt-csi-driver/kubevirt-csi-driver.go, parseLabels).
	infraClusterLabelsFlag = "--infra-cluster-labels="

	harnessControlPlaneKind = "HarnessControlPlane"
	// The played providers' finalizers.
	harnessCPFinalizer      = "controlplane.harness.volume-gate.test/finalizer"
	harnessInfraFinalizer   = "infrastructure.harness.volume-gate.test/finalizer"
	harnessProviderIDScheme = "harness://"
)

var (
	gvrCAPICluster         = schema.GroupVersionResource{Group: "cluster.x-k8s.io", Version: "v1beta2", Resource: "clusters"}
	gvrHarnessCluster      = schema.GroupVersionResource{Group: "infrastructure.cluster.x-k8s.io", Version: "v1alpha1", Resource: "harnessclusters"}
	gvrHarnessMachine      = schema.GroupVersionResource{Group: "infrastructure.cluster.x-k8s.io", Version: "v1alpha1", Resource: "harnessmachines"}
	gvrHarnessControlPlane = schema.GroupVersionResource{Group: "controlplane.cluster.x-k8s.io", Version: "v1alpha1", Resource: "harnesscontrolplanes"}
)

// capiProviderID is the providerID of cluster ns/name's one simulated node:
// every HarnessMachine of the cluster is that node (the tests run one
// Machine per cluster).
func capiProviderID(ns, cluster string) string {
	return harnessProviderIDScheme + ns + "/" + cluster + "/" + simNodeName
}

// capiKey is one played provider object to reconcile.
type capiKey struct {
	gvr      schema.GroupVersionResource
	ns, name string
}

// capiWorld plays the providers and follows each played Cluster's tenant.
type capiWorld struct {
	s *sim

	clusters      *lazyInformer // Cluster API Clusters (v1beta2)
	infraClusters *lazyInformer
	machines      *lazyInformer
	controlPlanes *lazyInformer

	q    workqueue.TypedRateLimitingInterface[capiKey]
	http *http.Client

	mu sync.Mutex
	// stopped maps a cluster ("ns/name") to the UID of the deleted
	// HarnessControlPlane that stopped its API server.
	stopped map[string]types.UID
}

// startCAPI watches the Cluster API objects (each informer starts once its
// CRD is served) and reconciles the played providers' objects.
func (s *sim) startCAPI(ctx context.Context, factory dynamicinformer.DynamicSharedInformerFactory) {
	c := &capiWorld{
		s:       s,
		q:       workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.NewTypedItemExponentialFailureRateLimiter[capiKey](500*time.Millisecond, 10*time.Second), workqueue.TypedRateLimitingQueueConfig[capiKey]{Name: "capi"}),
		http:    &http.Client{Timeout: 2 * time.Minute, Transport: &http.Transport{Proxy: nil}},
		stopped: map[string]types.UID{},
	}
	s.capi = c
	enqueue := func(gvr schema.GroupVersionResource) cache.ResourceEventHandler {
		add := func(obj any) {
			if o, ok := tombstone(obj).(*unstructured.Unstructured); ok && s.inScope(o.GetNamespace()) {
				c.q.Add(capiKey{gvr, o.GetNamespace(), o.GetName()})
				// A machine's change decides whether its cluster's node runs.
				if cl := o.GetLabels()[capiClusterNameLabel]; cl != "" && gvr == gvrHarnessMachine {
					s.kickTenantID(capiTenantID(o.GetNamespace(), cl))
				}
			}
		}
		return cache.ResourceEventHandlerFuncs{AddFunc: add, UpdateFunc: func(_, obj any) { add(obj) }, DeleteFunc: add}
	}
	c.clusters = newLazyInformer(s, factory, gvrCAPICluster, cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { c.onCluster(obj) },
		UpdateFunc: func(_, obj any) { c.onCluster(obj) },
		DeleteFunc: func(obj any) { c.onCluster(tombstone(obj)) },
	})
	c.infraClusters = newLazyInformer(s, factory, gvrHarnessCluster, enqueue(gvrHarnessCluster))
	c.machines = newLazyInformer(s, factory, gvrHarnessMachine, enqueue(gvrHarnessMachine))
	c.controlPlanes = newLazyInformer(s, factory, gvrHarnessControlPlane, enqueue(gvrHarnessControlPlane))
	for _, li := range []*lazyInformer{c.clusters, c.infraClusters, c.machines, c.controlPlanes} {
		s.wg.Go(func() { li.run(ctx) })
	}
	for range 4 {
		s.wg.Go(func() {
			drain(ctx, c.q, func(ctx context.Context, k capiKey) error { return c.reconcile(ctx, k) }, func(k capiKey, err error) {
				s.log.printf("capi", k.ns+"/"+k.name, "error", "%s: %v (retrying)", k.gvr.Resource, err)
			})
		})
	}
}

// capiTenantID is the simulator's registry key of a played Cluster's
// tenant: apart from Cozystack tenants, which may share a namespace and name.
func capiTenantID(ns, cluster string) string { return "capi " + ns + "/" + cluster }

// playedCluster reports whether a Cluster's control plane is a
// HarnessControlPlane, and names it.
func playedCluster(cl *unstructured.Unstructured) (string, bool) {
	kind, _, _ := unstructured.NestedString(cl.Object, "spec", "controlPlaneRef", "kind")
	group, _, _ := unstructured.NestedString(cl.Object, "spec", "controlPlaneRef", "apiGroup")
	name, _, _ := unstructured.NestedString(cl.Object, "spec", "controlPlaneRef", "name")
	return name, kind == harnessControlPlaneKind && group == gvrHarnessControlPlane.Group && name != ""
}

func (c *capiWorld) onCluster(obj any) {
	cl, ok := obj.(*unstructured.Unstructured)
	if !ok || !c.s.inScope(cl.GetNamespace()) {
		return
	}
	if _, played := playedCluster(cl); !played {
		return
	}
	c.s.ensureCAPITenant(cl.GetNamespace(), cl.GetName())
}

// wanted reports whether played Cluster ns/name exists: its tenant is
// followed until the Cluster is gone (Cluster API removes its finalizer
// last, after the control plane and the infrastructure).
func (c *capiWorld) wanted(ns, name string) bool {
	cl, ok, _ := c.clusters.get(ns, name)
	if !ok {
		return false
	}
	_, played := playedCluster(cl)
	return played
}

// isStopped reports whether the cluster's API server was stopped because
// its HarnessControlPlane was deleted.
func (c *capiWorld) isStopped(ns, name string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.stopped[ns+"/"+name]
	return ok
}

// machinesOf lists cluster ns/name's HarnessMachines: the names of those
// not being deleted, and those being deleted that still hold the
// infrastructure finalizer.
func (c *capiWorld) machinesOf(ns, name string) (live, deleting []string) {
	for _, m := range c.machines.list(ns, labels.SelectorFromSet(labels.Set{capiClusterNameLabel: name})) {
		switch {
		case m.GetDeletionTimestamp() == nil:
			live = append(live, m.GetName())
		case slices.Contains(m.GetFinalizers(), harnessInfraFinalizer):
			deleting = append(deleting, m.GetName())
		}
	}
	slices.Sort(live)
	slices.Sort(deleting)
	return live, deleting
}

// releaseMachines drops the infrastructure finalizer of deleted machines
// whose node is down or held by another machine.
func (c *capiWorld) releaseMachines(ctx context.Context, ns string, names []string) {
	api := c.s.dyn.Resource(gvrHarnessMachine).Namespace(ns)
	for _, n := range names {
		if removed, err := removeFinalizerDynamic(ctx, api, n, "", harnessInfraFinalizer); err != nil {
			c.s.log.printf("capi", ns+"/"+n, "error", "HarnessMachine %s: remove finalizer: %v", n, err)
		} else if removed {
			c.s.log.printf("capi", ns+"/"+n, "machine-released", "HarnessMachine %s: %s removed", n, harnessInfraFinalizer)
		}
	}
}

func (c *capiWorld) reconcile(ctx context.Context, k capiKey) error {
	var li *lazyInformer
	switch k.gvr {
	case gvrHarnessControlPlane:
		li = c.controlPlanes
	case gvrHarnessCluster:
		li = c.infraClusters
	case gvrHarnessMachine:
		li = c.machines
	default:
		return nil
	}
	obj, ok, _ := li.get(k.ns, k.name)
	if !ok {
		return nil
	}
	switch k.gvr {
	case gvrHarnessControlPlane:
		return c.reconcileControlPlane(ctx, obj)
	case gvrHarnessCluster:
		return c.reconcileInfraCluster(ctx, obj)
	default:
		return c.reconcileMachine(ctx, obj)
	}
}

// harnessCluster is the control API's word on a harness cluster: where its
// API server is and its admin kubeconfig file.
type harnessCluster struct {
	Server     string `json:"server"`
	Kubeconfig string `json:"kubeconfig"`
}

func (c *capiWorld) harnessCluster(ctx context.Context, obj *unstructured.Unstructured) (*harnessCluster, error) {
	name := obj.GetAnnotations()[annHarnessCluster]
	if name == "" {
		return nil, fmt.Errorf("%s %s/%s has no annotation %s naming the harness cluster that is its tenant API server", obj.GetKind(), obj.GetNamespace(), obj.GetName(), annHarnessCluster)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.s.cfg.control+"/clusters/"+url.PathEscape(name), nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s: %s", req.URL, resp.Status, strings.TrimSpace(string(body)))
	}
	var info harnessCluster
	if err := json.Unmarshal(body, &info); err != nil {
		return nil, fmt.Errorf("GET %s: %w", req.URL, err)
	}
	return &info, nil
}

func (c *capiWorld) reconcileControlPlane(ctx context.Context, cp *unstructured.Unstructured) error {
	ns := cp.GetNamespace()
	cluster := cp.GetLabels()[capiClusterNameLabel]
	key := ns + "/" + cluster
	api := c.s.dyn.Resource(gvrHarnessControlPlane).Namespace(ns)
	if cp.GetDeletionTimestamp() != nil {
		if !slices.Contains(cp.GetFinalizers(), harnessCPFinalizer) {
			return nil
		}
		if cluster != "" {
			c.mu.Lock()
			c.stopped[key] = cp.GetUID()
			c.mu.Unlock()
			c.s.kickTenantID(capiTenantID(ns, cluster))
		}
		if name := cp.GetAnnotations()[annHarnessCluster]; name != "" {
			c.s.log.printf("capi", key, "stopping", "HarnessControlPlane %s deleted: stopping tenant API server (harness cluster %s)", cp.GetName(), name)
			if err := c.s.kamaji.stopCluster(ctx, name); err != nil {
				return fmt.Errorf("stop harness cluster %s: %w", name, err)
			}
			c.s.log.printf("capi", key, "stopped", "tenant API server (harness cluster %s) stopped", name)
		}
		if removed, err := removeFinalizerDynamic(ctx, api, cp.GetName(), cp.GetUID(), harnessCPFinalizer); err != nil {
			return err
		} else if removed {
			c.s.log.printf("capi", key, "finalizer-removed", "HarnessControlPlane %s: %s removed", cp.GetName(), harnessCPFinalizer)
		}
		return nil
	}
	if err := addFinalizerDynamic(ctx, api, cp, harnessCPFinalizer); err != nil {
		return err
	}
	c.mu.Lock()
	if uid, ok := c.stopped[key]; ok && uid != cp.GetUID() {
		delete(c.stopped, key)
	}
	c.mu.Unlock()
	if cluster == "" {
		// Cluster API's Cluster controller labels it (and requeues us).
		return nil
	}
	info, err := c.harnessCluster(ctx, cp)
	if err != nil {
		return err
	}
	if err := c.ensureKubeconfig(ctx, cp, cluster, info); err != nil {
		return err
	}
	if done, _, _ := unstructured.NestedBool(cp.Object, "status", "initialization", "controlPlaneInitialized"); !done {
		patch := map[string]any{"status": map[string]any{
			"initialization": map[string]any{"controlPlaneInitialized": true},
		}}
		if err := mergeStatus(ctx, c, gvrHarnessControlPlane, cp, patch); err != nil {
			return err
		}
		c.s.log.printf("capi", key, "control-plane", "HarnessControlPlane %s initialized: tenant API %s", cp.GetName(), info.Server)
	}
	return nil
}

// ensureKubeconfig writes the Secret <cluster>-kubeconfig as a control
// plane provider does, owned by the control plane, unless it is there.
func (c *capiWorld) ensureKubeconfig(ctx context.Context, cp *unstructured.Unstructured, cluster string, info *harnessCluster) error {
	name := cluster + capiKubeconfigSuffix
	secrets := c.s.mgmt.CoreV1().Secrets(cp.GetNamespace())
	if _, err := secrets.Get(ctx, name, metav1.GetOptions{}); err == nil || !apierrors.IsNotFound(err) {
		return err
	}
	data, err := os.ReadFile(info.Kubeconfig)
	if err != nil {
		return fmt.Errorf("read the harness cluster's kubeconfig: %w", err)
	}
	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: cp.GetNamespace(),
			Labels: map[string]string{capiClusterNameLabel: cluster},
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: cp.GetAPIVersion(), Kind: cp.GetKind(), Name: cp.GetName(), UID: cp.GetUID(),
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true),
			}},
		},
		Type: capiSecretType,
		Data: map[string][]byte{capiKubeconfigKey: data},
	}
	if _, err := secrets.Create(ctx, secret, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	c.s.log.printf("capi", cp.GetNamespace()+"/"+cluster, "kubeconfig", "Secret %s written (key %s)", name, capiKubeconfigKey)
	return nil
}

func (c *capiWorld) reconcileInfraCluster(ctx context.Context, ic *unstructured.Unstructured) error {
	api := c.s.dyn.Resource(gvrHarnessCluster).Namespace(ic.GetNamespace())
	key := ic.GetNamespace() + "/" + ic.GetName()
	if ic.GetDeletionTimestamp() != nil {
		if removed, err := removeFinalizerDynamic(ctx, api, ic.GetName(), ic.GetUID(), harnessInfraFinalizer); err != nil {
			return err
		} else if removed {
			c.s.log.printf("capi", key, "finalizer-removed", "HarnessCluster %s: %s removed", ic.GetName(), harnessInfraFinalizer)
		}
		return nil
	}
	if err := addFinalizerDynamic(ctx, api, ic, harnessInfraFinalizer); err != nil {
		return err
	}
	if host, _, _ := unstructured.NestedString(ic.Object, "spec", "controlPlaneEndpoint", "host"); host == "" {
		info, err := c.harnessCluster(ctx, ic)
		if err != nil {
			return err
		}
		u, err := url.Parse(info.Server)
		if err != nil {
			return fmt.Errorf("harness cluster server %q: %w", info.Server, err)
		}
		port, err := strconv.Atoi(u.Port())
		if err != nil {
			return fmt.Errorf("harness cluster server %q has no port", info.Server)
		}
		patch, _ := json.Marshal(map[string]any{"spec": map[string]any{"controlPlaneEndpoint": map[string]any{"host": u.Hostname(), "port": port}}})
		if _, err := api.Patch(ctx, ic.GetName(), types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			return err
		}
		c.s.log.printf("capi", key, "endpoint", "HarnessCluster %s: controlPlaneEndpoint %s", ic.GetName(), u.Host)
	}
	if done, _, _ := unstructured.NestedBool(ic.Object, "status", "initialization", "provisioned"); !done {
		return mergeStatus(ctx, c, gvrHarnessCluster, ic, map[string]any{"status": map[string]any{
			"initialization": map[string]any{"provisioned": true},
		}})
	}
	return nil
}

func (c *capiWorld) reconcileMachine(ctx context.Context, m *unstructured.Unstructured) error {
	ns := m.GetNamespace()
	api := c.s.dyn.Resource(gvrHarnessMachine).Namespace(ns)
	cluster := m.GetLabels()[capiClusterNameLabel]
	if m.GetDeletionTimestamp() != nil {
		// The cluster's tenant worker takes the node down first, if this was
		// its last machine, and then drops the finalizer; with no tenant
		// followed there is no node to take down.
		if !c.s.hasTenant(capiTenantID(ns, cluster)) {
			c.releaseMachines(ctx, ns, []string{m.GetName()})
		}
		return nil
	}
	if cluster == "" {
		return fmt.Errorf("HarnessMachine %s/%s has no label %s: a MachineSet sets it", ns, m.GetName(), capiClusterNameLabel)
	}
	if err := addFinalizerDynamic(ctx, api, m, harnessInfraFinalizer); err != nil {
		return err
	}
	want := capiProviderID(ns, cluster)
	if id, _, _ := unstructured.NestedString(m.Object, "spec", "providerID"); id != want {
		patch, _ := json.Marshal(map[string]any{"spec": map[string]any{"providerID": want}})
		if _, err := api.Patch(ctx, m.GetName(), types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			return err
		}
		c.s.log.printf("capi", ns+"/"+cluster, "machine", "HarnessMachine %s: providerID %s", m.GetName(), want)
	}
	if done, _, _ := unstructured.NestedBool(m.Object, "status", "initialization", "provisioned"); !done {
		return mergeStatus(ctx, c, gvrHarnessMachine, m, map[string]any{"status": map[string]any{
			"initialization": map[string]any{"provisioned": true},
		}})
	}
	return nil
}

// mergeStatus merge-patches obj's status subresource.
func mergeStatus(ctx context.Context, c *capiWorld, gvr schema.GroupVersionResource, obj *unstructured.Unstructured, patch map[string]any) error {
	b, err := json.Marshal(patch)
	if err != nil {
		return err
	}
	_, err = c.s.dyn.Resource(gvr).Namespace(obj.GetNamespace()).Patch(ctx, obj.GetName(), types.MergePatchType, b, metav1.PatchOptions{}, "status")
	return err
}

// addFinalizerDynamic adds finalizer f to obj unless it holds it, guarded
// by a test of the current list (a concurrent change fails it: retried).
func addFinalizerDynamic(ctx context.Context, api interface {
	Patch(context.Context, string, types.PatchType, []byte, metav1.PatchOptions, ...string) (*unstructured.Unstructured, error)
}, obj *unstructured.Unstructured, f string) error {
	current := obj.GetFinalizers()
	if slices.Contains(current, f) {
		return nil
	}
	var ops []map[string]any
	if current == nil {
		ops = []map[string]any{{"op": "add", "path": "/metadata/finalizers", "value": []string{f}}}
	} else {
		ops = []map[string]any{
			{"op": "test", "path": "/metadata/finalizers", "value": current},
			{"op": "add", "path": "/metadata/finalizers/-", "value": f},
		}
	}
	b, err := json.Marshal(ops)
	if err != nil {
		return err
	}
	_, err = api.Patch(ctx, obj.GetName(), types.JSONPatchType, b, metav1.PatchOptions{})
	return err
}

// reconcileCAPI is a played Cluster's tenant's round: its node (kubelet)
// runs while the API answers and one HarnessMachine of the cluster is not
// being deleted, and its CSI driver, whose controller runs on that node,
// with it; or, management-side, while the API answers and the
// controller's Deployment is there. Deleted machines are released once
// the node is down (or held by another machine).
func (t *tenant) reconcileCAPI(ctx context.Context, up bool, why string) {
	live, deleting := t.s.capi.machinesOf(t.ns, t.name)
	on, offWhy := up, why
	if up && len(live) == 0 {
		on, offWhy = false, "no HarnessMachine of the cluster left: its node is gone"
	}
	driverOn, driverWhy := on, "its controller ran on the node: "+offWhy
	if t.csiController == "" {
		t.csiController = t.s.capi.csiControllerOf(t.ns, t.name)
	}
	if t.csiController != "" {
		m, ok, mwhy := t.managementController(t.csiController)
		switch {
		case !up:
			driverOn, driverWhy = false, "tenant API down: "+why
		case !ok:
			driverOn, driverWhy = false, mwhy
		default:
			driverOn = true
			if t.driver == nil {
				t.setManagementCSI(m)
			}
		}
	}
	t.setWorkers(on, driverOn, offWhy, driverWhy)
	if len(deleting) > 0 && (len(live) > 0 || t.kubelet == nil) {
		t.s.capi.releaseMachines(ctx, t.ns, deleting)
	}
}

// csiControllerOf names played Cluster ns/name's management-side CSI
// controller Deployment: the annotation on the HarnessCluster its
// spec.infrastructureRef names; "" for the in-tenant shape.
func (c *capiWorld) csiControllerOf(ns, name string) string {
	cl, ok, _ := c.clusters.get(ns, name)
	if !ok {
		return ""
	}
	infra, _, _ := unstructured.NestedString(cl.Object, "spec", "infrastructureRef", "name")
	ic, ok, _ := c.infraClusters.get(ns, infra)
	if !ok {
		return ""
	}
	return ic.GetAnnotations()[annCSIController]
}

// managementController reads the management-side CSI controller
// Deployment `name`: whether it runs (sim_tenant.go controllerDeployment),
// the ServiceAccount its Pods run as and the labels its csi-driver
// container passes with --infra-cluster-labels, parsed as the driver does.
func (t *tenant) managementController(name string) (*managementCSI, bool, string) {
	if t.s.deploys == nil {
		return nil, false, fmt.Sprintf("HarnessCluster annotation %s names a management-side CSI controller, which needs the simulator's infra layer (a profile that names infra)", annCSIController)
	}
	if ok, why := t.controllerDeployment(name); !ok {
		return nil, false, why
	}
	d, _, _ := t.s.deploys.get(t.ns, name)
	sa, _, _ := unstructured.NestedString(d.Object, "spec", "template", "spec", "serviceAccountName")
	containers, _, _ := unstructured.NestedSlice(d.Object, "spec", "template", "spec", "containers")
	var flag string
	for _, c := range containers {
		args, _, _ := unstructured.NestedStringSlice(c.(map[string]any), "args")
		for _, a := range args {
			if v, ok := strings.CutPrefix(a, infraClusterLabelsFlag); ok {
				flag = v
			}
		}
	}
	labels := map[string]string{}
	for _, pair := range strings.Split(flag, ",") {
		k, v, ok := strings.Cut(pair, "=")
		if !ok || k == "" {
			return nil, false, fmt.Sprintf("Deployment %s/%s: %s%q is not name=value pairs separated by commas", t.ns, name, infraClusterLabelsFlag, flag)
		}
		labels[k] = v
	}
	if sa == "" {
		return nil, false, fmt.Sprintf("Deployment %s/%s names no serviceAccountName", t.ns, name)
	}
	return &managementCSI{deployment: name, serviceAccount: sa, labels: labels}, true, ""
}

// capiDiskOwner names the played Cluster API cluster in namespace ns
// whose management-side controller labels its disks with `labels`; "" if
// none.
func (s *sim) capiDiskOwner(ns string, labels map[string]string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, t := range s.tenants {
		m := t.managementCSI()
		if !t.capi || t.ns != ns || m == nil || len(m.labels) == 0 {
			continue
		}
		match := true
		for k, v := range m.labels {
			if labels[k] != v {
				match = false
			}
		}
		if match {
			return t.name
		}
	}
	return ""
}

// kickCAPIIn kicks the played Cluster API clusters of namespace ns (a
// Deployment there may be one's management-side CSI controller).
func (s *sim) kickCAPIIn(ns string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, t := range s.tenants {
		if t.capi && t.ns == ns {
			t.kickNow()
		}
	}
}
