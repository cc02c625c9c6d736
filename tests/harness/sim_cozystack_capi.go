package main

// Cozystack's Cluster API providers, played behind Cluster API's v1beta1
// contract (the one each of their CRDs declares with its label
// cluster.x-k8s.io/v1beta1 in Cozystack v1.6.2's
// packages/system/capi-providers-{cpprovider,infraprovider,bootstrap}/files/
// *-components.yaml), next to Cluster API's own core manager at Cozystack's
// version (tests/capi-cozystack, v1.10.1), which reconciles the tenant
// chart's Cluster, MachineDeployment, MachineSets, Machines and
// MachineHealthCheck. What each writes, read in the provider's source:
//
//   - Kamaji's control plane provider (clastix/cluster-api-control-plane-
//     provider-kamaji v0.19.0, which Cozystack ships as v0.19.0-cozystack.0;
//     controllers/kamajicontrolplane_controller*.go). For a
//     KamajiControlPlane once the Cluster controller owns it: the
//     TenantControlPlane of its name, which it makes
//     (createOrUpdateTenantControlPlane: controller reference, spec from the
//     KamajiControlPlane's), so deleting the KamajiControlPlane lets the
//     garbage collector delete it. Here the tests make that
//     TenantControlPlane first, naming the harness cluster that is its API
//     server (tests/testkit/src/tenant), and the provider takes it as its
//     own: the reverse of the platform's order, with the same result. Then
//     its spec.controlPlaneEndpoint from the TenantControlPlane's status
//     (patchControlPlaneEndpoint); the KubevirtCluster's
//     spec.controlPlaneEndpoint and status.ready (patchCluster: Kamaji
//     manages a KubevirtCluster, annotated cluster.x-k8s.io/managed-by,
//     which CAPK leaves alone); once the TenantControlPlane's version is
//     Ready, status.initialized; the Secret <cluster>-kubeconfig, rewritten
//     whenever it differs (the TenantControlPlane's admin kubeconfig, the
//     key its annotation kamaji.clastix.io/kubeconfig-secret-key names, as
//     `value`, owned by the KamajiControlPlane: createOrUpdateKubeconfig);
//     and status.ready, version, replicas and externalManagedControlPlane
//     (true: the CRD's default), kept current. Not played: the CA Secret
//     <cluster>-ca, which upstream copies before it reports ready (no
//     kubeadm bootstrap here reads it, so that precondition is skipped),
//     and the external cluster reference.
//   - CAPK (kubernetes-sigs/cluster-api-provider-kubevirt v0.1.10, which
//     Cozystack ships as v0.1.10-infraprovider; controllers/
//     kubevirtmachine_controller.go, pkg/kubevirt/machine.go, utils.go).
//     For a KubevirtMachine owned by a Machine whose bootstrap data is
//     there: its finalizer, the VirtualMachine of its name in the namespace
//     of its virtualMachineTemplate (labels kubevirt.io/vm, name,
//     cluster.x-k8s.io/role, cluster.x-k8s.io/cluster-name,
//     capk.cluster.x-k8s.io/kubevirt-machine-name and -namespace; no owner),
//     spec.providerID kubevirt://<name> and status.ready. Deleted
//     (reconcileDelete): the VirtualMachine deleted and the finalizer
//     removed in the same pass, not waiting for the VM to be gone. Not
//     played: its wait for the Cluster's infrastructure (a MachineSet's
//     machines come after it: Cluster API's preflight checks), the VM's
//     bootstrap check (Cozystack's checkStrategy none), the Node's
//     providerID CAPK writes itself (the simulated kubelet reports it), its
//     drain of the VMI's node, live migration.
//   - CABPT (siderolabs/cluster-api-bootstrap-provider-talos v0.6.12;
//     controllers/talosconfig_controller.go, secrets.go). For a
//     TalosConfig owned by a Machine: the Secret <machine>-bootstrap-data
//     (key `value`, labelled with the cluster, its controller the
//     TalosConfig: writeBootstrapData) and status.ready,
//     status.dataSecretName. Not played: its wait for the Cluster's
//     infrastructure, as above, and the machine configuration itself
//     (nothing here boots Talos).
//
// The tenant's node is its VM: the tenant's simulated kubelet runs while a
// KubevirtMachine of the cluster, not being deleted, has its VM, not being
// deleted, and reports that machine's providerID on its Node, by which
// Cluster API's Machine controller finds it
// (internal/controllers/machine/machine_controller_noderef.go). One node
// per tenant: the simulated Node is `sim-node` whatever the VM, and a set
// providerID never changes, so a tenant has one machine for its life (the
// tenant chart's node group of `nodes: 1`, never rolled out); a second
// machine of the cluster gets no node. The names here are Cluster API's and
// the providers', not the profile's.

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"slices"
	"strconv"
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
	// kamajiKubeconfigKeyAnnotation on a KamajiControlPlane names the key
	// of the admin kubeconfig that <cluster>-kubeconfig copies (the
	// provider's default: admin.conf).
	kamajiKubeconfigKeyAnnotation = "kamaji.clastix.io/kubeconfig-secret-key"
	kamajiDefaultKubeconfigKey    = "admin.conf"
	// capkMachineFinalizer is CAPK's (api/v1alpha1 MachineFinalizer).
	capkMachineFinalizer = "kubevirtmachine.infrastructure.cluster.x-k8s.io"
	// capkMachineNameLabel and capkMachineNamespaceLabel: CAPK's labels of
	// a VM naming its KubevirtMachine (api/v1alpha1/kubevirtcluster_types.go).
	capkMachineNameLabel      = "capk.cluster.x-k8s.io/kubevirt-machine-name"
	capkMachineNamespaceLabel = "capk.cluster.x-k8s.io/kubevirt-machine-namespace"
	// capkProviderIDScheme is CAPK's providerID (GenerateProviderID).
	capkProviderIDScheme = "kubevirt://"
	// cabptDataSecretSuffix names a machine's bootstrap data Secret
	// (secrets.go writeBootstrapData: <owner>-bootstrap-data).
	cabptDataSecretSuffix = "-bootstrap-data"
)

var (
	gvrCAPIClusterV1beta1 = schema.GroupVersionResource{Group: "cluster.x-k8s.io", Version: "v1beta1", Resource: "clusters"}
	gvrMachineV1beta1     = schema.GroupVersionResource{Group: "cluster.x-k8s.io", Version: "v1beta1", Resource: "machines"}
	gvrKubevirtCluster    = schema.GroupVersionResource{Group: "infrastructure.cluster.x-k8s.io", Version: "v1alpha1", Resource: "kubevirtclusters"}
	gvrKubevirtMachine    = schema.GroupVersionResource{Group: "infrastructure.cluster.x-k8s.io", Version: "v1alpha1", Resource: "kubevirtmachines"}
	gvrTalosConfig        = schema.GroupVersionResource{Group: "bootstrap.cluster.x-k8s.io", Version: "v1alpha3", Resource: "talosconfigs"}
)

// cozyCAPI plays Cozystack's Cluster API providers.
type cozyCAPI struct {
	s *sim

	kcps     *lazyInformer // KamajiControlPlanes
	machines *lazyInformer // KubevirtMachines
	configs  *lazyInformer // TalosConfigs
	vms      *lazyInformer // VirtualMachines (the machines' VMs)

	q workqueue.TypedRateLimitingInterface[capiKey]
}

// startCozystackCAPI watches the providers' objects (each informer starts
// once its CRD is served) and reconciles them.
func (s *sim) startCozystackCAPI(ctx context.Context, factory dynamicinformer.DynamicSharedInformerFactory) {
	c := &cozyCAPI{
		s: s,
		q: workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.NewTypedItemExponentialFailureRateLimiter[capiKey](500*time.Millisecond, 10*time.Second), workqueue.TypedRateLimitingQueueConfig[capiKey]{Name: "cozystack-capi"}),
	}
	s.cozy = c
	enqueue := func(gvr schema.GroupVersionResource) cache.ResourceEventHandler {
		add := func(obj any) {
			o, ok := tombstone(obj).(*unstructured.Unstructured)
			if !ok || !s.inScope(o.GetNamespace()) {
				return
			}
			if gvr != gvrVM {
				c.q.Add(capiKey{gvr, o.GetNamespace(), o.GetName()})
			}
			// A machine's or its VM's change decides whether the
			// cluster's node runs.
			if cl := o.GetLabels()[capiClusterNameLabel]; cl != "" && (gvr == gvrKubevirtMachine || gvr == gvrVM) {
				s.kickTenant(o.GetNamespace(), cl)
			}
		}
		return cache.ResourceEventHandlerFuncs{AddFunc: add, UpdateFunc: func(_, obj any) { add(obj) }, DeleteFunc: add}
	}
	c.kcps = newLazyInformer(s, factory, gvrKCP, enqueue(gvrKCP))
	c.machines = newLazyInformer(s, factory, gvrKubevirtMachine, enqueue(gvrKubevirtMachine))
	c.configs = newLazyInformer(s, factory, gvrTalosConfig, enqueue(gvrTalosConfig))
	c.vms = newLazyInformer(s, factory, gvrVM, enqueue(gvrVM))
	for _, li := range []*lazyInformer{c.kcps, c.machines, c.configs, c.vms} {
		s.wg.Go(func() { li.run(ctx) })
	}
	for range 2 {
		s.wg.Go(func() {
			drain(ctx, c.q, func(ctx context.Context, k capiKey) error { return c.reconcile(ctx, k) }, func(k capiKey, err error) {
				s.log.printf("capi", k.ns+"/"+k.name, "error", "%s: %v (retrying)", k.gvr.Resource, err)
			})
		})
	}
}

func (c *cozyCAPI) reconcile(ctx context.Context, k capiKey) error {
	switch k.gvr {
	case gvrKCP:
		if kcp, ok, _ := c.kcps.get(k.ns, k.name); ok {
			return c.reconcileControlPlane(ctx, kcp)
		}
	case gvrKubevirtMachine:
		if m, ok, _ := c.machines.get(k.ns, k.name); ok {
			return c.reconcileMachine(ctx, m)
		}
	case gvrTalosConfig:
		if tc, ok, _ := c.configs.get(k.ns, k.name); ok {
			return c.reconcileBootstrap(ctx, tc)
		}
	}
	return nil
}

// ownerOfKind is the name of obj's owner of this kind, or "".
func ownerOfKind(obj *unstructured.Unstructured, kind string) string {
	for _, o := range obj.GetOwnerReferences() {
		if o.Kind == kind {
			return o.Name
		}
	}
	return ""
}

// reconcileControlPlane is Kamaji's provider's reconcile of a
// KamajiControlPlane, in its order.
func (c *cozyCAPI) reconcileControlPlane(ctx context.Context, kcp *unstructured.Unstructured) error {
	ns, name := kcp.GetNamespace(), kcp.GetName()
	key := ns + "/" + name
	if kcp.GetDeletionTimestamp() != nil {
		// No finalizer without an external cluster reference.
		return nil
	}
	if len(kcp.GetOwnerReferences()) == 0 {
		// "missing OwnerReference from the Cluster controller, waiting for it"
		return nil
	}
	clusterName := kcp.GetOwnerReferences()[0].Name
	cluster, err := c.s.dyn.Resource(gvrCAPIClusterV1beta1).Namespace(ns).Get(ctx, clusterName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if paused, _, _ := unstructured.NestedBool(cluster.Object, "spec", "paused"); paused {
		return nil
	}
	tcp, err := c.adoptTenantControlPlane(ctx, kcp)
	if err != nil || tcp == nil {
		return err
	}
	endpoint, _, _ := unstructured.NestedString(tcp.Object, "status", "controlPlaneEndpoint")
	if endpoint == "" {
		c.q.AddAfter(capiKey{gvrKCP, ns, name}, time.Second)
		return nil
	}
	host, portText, err := net.SplitHostPort(endpoint)
	if err != nil {
		return fmt.Errorf("TenantControlPlane %s: endpoint %q: %w", key, endpoint, err)
	}
	port, err := strconv.ParseInt(portText, 10, 32)
	if err != nil {
		return fmt.Errorf("TenantControlPlane %s: endpoint %q: %w", key, endpoint, err)
	}
	want := map[string]any{"host": host, "port": port}
	if got, _, _ := unstructured.NestedMap(kcp.Object, "spec", "controlPlaneEndpoint"); fmt.Sprint(got) != fmt.Sprint(want) {
		if err := c.mergePatch(ctx, gvrKCP, ns, name, map[string]any{"spec": map[string]any{"controlPlaneEndpoint": want}}, ""); err != nil {
			return err
		}
		c.s.log.printf("capi", key, "endpoint", "KamajiControlPlane %s: controlPlaneEndpoint %s", name, endpoint)
	}
	if err := c.patchInfraCluster(ctx, cluster, want); err != nil {
		return err
	}
	if host, _, _ := unstructured.NestedString(cluster.Object, "spec", "controlPlaneEndpoint", "host"); host == "" {
		// "Control Plane endpoint still unprocessed, enqueuing back"
		c.q.AddAfter(capiKey{gvrKCP, ns, name}, time.Second)
		return nil
	}
	if ready, _, _ := unstructured.NestedBool(cluster.Object, "status", "infrastructureReady"); !ready {
		c.q.AddAfter(capiKey{gvrKCP, ns, name}, time.Second)
		return nil
	}
	versionStatus, _, _ := unstructured.NestedString(tcp.Object, "status", "kubernetesResources", "version", "status")
	version, _, _ := unstructured.NestedString(tcp.Object, "status", "kubernetesResources", "version", "version")
	initialized, _, _ := unstructured.NestedBool(kcp.Object, "status", "initialized")
	if versionStatus == "Ready" && !initialized {
		if err := c.mergePatch(ctx, gvrKCP, ns, name, map[string]any{"status": map[string]any{"initialized": true, "externalManagedControlPlane": true}}, "status"); err != nil {
			return err
		}
		initialized = true
		c.s.log.printf("capi", key, "control-plane", "KamajiControlPlane %s initialized: TenantControlPlane %s is Ready", name, name)
	}
	if !initialized {
		// "not yet initialized, enqueuing back"
		c.q.AddAfter(capiKey{gvrKCP, ns, name}, time.Second)
		return nil
	}
	if err := c.ensureKubeconfig(ctx, kcp, clusterName, tcp); err != nil {
		return err
	}
	replicas, _, _ := unstructured.NestedInt64(kcp.Object, "spec", "replicas")
	desired := map[string]any{
		"initialized": true, "externalManagedControlPlane": true, "version": version,
		"ready":    versionStatus == "Ready" || versionStatus == "Upgrading",
		"replicas": replicas, "readyReplicas": replicas, "updatedReplicas": replicas, "unavailableReplicas": int64(0),
		"selector": metav1.FormatLabelSelector(&metav1.LabelSelector{MatchLabels: kcp.GetLabels()}),
	}
	status, _, _ := unstructured.NestedMap(kcp.Object, "status")
	stale := false
	for k, v := range desired {
		stale = stale || fmt.Sprint(status[k]) != fmt.Sprint(v)
	}
	if stale {
		if err := c.mergePatch(ctx, gvrKCP, ns, name, map[string]any{"status": desired}, "status"); err != nil {
			return err
		}
		c.s.log.printf("capi", key, "control-plane", "KamajiControlPlane %s: ready %v, version %s", name, desired["ready"], version)
	}
	if desired["ready"] != true {
		c.q.AddAfter(capiKey{gvrKCP, ns, name}, time.Second)
	}
	return nil
}

// adoptTenantControlPlane gives the TenantControlPlane of the
// KamajiControlPlane's name its controller reference; nil while there is
// none.
func (c *cozyCAPI) adoptTenantControlPlane(ctx context.Context, kcp *unstructured.Unstructured) (*unstructured.Unstructured, error) {
	ns, name := kcp.GetNamespace(), kcp.GetName()
	tcp, ok, _ := c.s.tcps.get(ns, name)
	if !ok {
		c.s.log.printf("capi", ns+"/"+name, "waiting", "KamajiControlPlane %s: no TenantControlPlane %s yet (the tests make it first, naming the harness cluster that serves it)", name, name)
		c.q.AddAfter(capiKey{gvrKCP, ns, name}, 2*time.Second)
		return nil, nil
	}
	if tcp.GetDeletionTimestamp() != nil {
		return nil, nil
	}
	version, _, _ := unstructured.NestedString(kcp.Object, "spec", "version")
	current, _, _ := unstructured.NestedString(tcp.Object, "spec", "kubernetes", "version")
	owned := false
	for _, o := range tcp.GetOwnerReferences() {
		owned = owned || o.UID == kcp.GetUID()
	}
	if owned && current == version {
		return tcp, nil
	}
	owners := tcp.GetOwnerReferences()
	if !owned {
		owners = append(slices.Clone(owners), metav1.OwnerReference{
			APIVersion: kcp.GetAPIVersion(), Kind: kcp.GetKind(), Name: name, UID: kcp.GetUID(),
			Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true),
		})
	}
	// The TenantControlPlane's spec from the KamajiControlPlane's, of
	// which the version is what Cluster API reads back (status.version).
	patch, _ := json.Marshal(map[string]any{
		"metadata": map[string]any{"ownerReferences": owners, "resourceVersion": tcp.GetResourceVersion()},
		"spec":     map[string]any{"kubernetes": map[string]any{"version": version}},
	})
	adopted, err := c.s.dyn.Resource(gvrTCP).Namespace(ns).Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{})
	if err != nil {
		return nil, fmt.Errorf("own TenantControlPlane %s/%s: %w", ns, name, err)
	}
	c.s.log.printf("capi", ns+"/"+name, "control-plane", "TenantControlPlane %s: owned by KamajiControlPlane %s, Kubernetes %s", name, name, version)
	return adopted, nil
}

// patchInfraCluster writes the KubevirtCluster's endpoint and readiness,
// as Kamaji's provider does for the infrastructure it manages.
func (c *cozyCAPI) patchInfraCluster(ctx context.Context, cluster *unstructured.Unstructured, endpoint map[string]any) error {
	ref, _, _ := unstructured.NestedStringMap(cluster.Object, "spec", "infrastructureRef")
	if ref["kind"] != "KubevirtCluster" || ref["name"] == "" {
		return fmt.Errorf("Cluster %s/%s: infrastructureRef %v is not a KubevirtCluster (the infrastructure Kamaji's provider patches here)", cluster.GetNamespace(), cluster.GetName(), ref)
	}
	ns := ref["namespace"]
	if ns == "" {
		ns = cluster.GetNamespace()
	}
	ic, err := c.s.dyn.Resource(gvrKubevirtCluster).Namespace(ns).Get(ctx, ref["name"], metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("KubevirtCluster %s/%s: %w", ns, ref["name"], err)
	}
	if got, _, _ := unstructured.NestedMap(ic.Object, "spec", "controlPlaneEndpoint"); fmt.Sprint(got) != fmt.Sprint(endpoint) {
		if err := c.mergePatch(ctx, gvrKubevirtCluster, ns, ic.GetName(), map[string]any{"spec": map[string]any{"controlPlaneEndpoint": endpoint}}, ""); err != nil {
			return err
		}
	}
	if ready, _, _ := unstructured.NestedBool(ic.Object, "status", "ready"); !ready {
		if err := c.mergePatch(ctx, gvrKubevirtCluster, ns, ic.GetName(), map[string]any{"status": map[string]any{"ready": true}}, "status"); err != nil {
			return err
		}
		c.s.log.printf("capi", ns+"/"+cluster.GetName(), "infrastructure", "KubevirtCluster %s: controlPlaneEndpoint %v:%v, ready", ic.GetName(), endpoint["host"], endpoint["port"])
	}
	return nil
}

// ensureKubeconfig writes the Secret <cluster>-kubeconfig from the
// TenantControlPlane's admin kubeconfig, unless it is there.
func (c *cozyCAPI) ensureKubeconfig(ctx context.Context, kcp *unstructured.Unstructured, cluster string, tcp *unstructured.Unstructured) error {
	name := cluster + capiKubeconfigSuffix
	secrets := c.s.mgmt.CoreV1().Secrets(kcp.GetNamespace())
	current, err := secrets.Get(ctx, name, metav1.GetOptions{})
	missing := apierrors.IsNotFound(err)
	if err != nil && !missing {
		return err
	}
	source, _, _ := unstructured.NestedString(tcp.Object, "status", "kubeconfig", "admin", "secretName")
	if source == "" {
		c.q.AddAfter(capiKey{gvrKCP, kcp.GetNamespace(), kcp.GetName()}, time.Second)
		return nil
	}
	admin, err := secrets.Get(ctx, source, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("the TenantControlPlane's admin kubeconfig %s: %w", source, err)
	}
	key := kcp.GetAnnotations()[kamajiKubeconfigKeyAnnotation]
	if key == "" {
		key = kamajiDefaultKubeconfigKey
	}
	data := admin.Data[key]
	if len(data) == 0 {
		return fmt.Errorf("the admin kubeconfig %s has no key %s (annotation %s)", source, key, kamajiKubeconfigKeyAnnotation)
	}
	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: kcp.GetNamespace(),
			Labels: map[string]string{capiClusterNameLabel: cluster, "kamaji.clastix.io/component": "capi", "kamaji.clastix.io/secret": "kubeconfig",
				"kamaji.clastix.io/cluster": cluster, "kamaji.clastix.io/tcp": tcp.GetName()},
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: kcp.GetAPIVersion(), Kind: kcp.GetKind(), Name: kcp.GetName(), UID: kcp.GetUID(),
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true),
			}},
		},
		Type: capiSecretType,
		Data: map[string][]byte{capiKubeconfigKey: data},
	}
	switch {
	case missing:
		if _, err := secrets.Create(ctx, secret, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return err
		}
	case string(current.Data[capiKubeconfigKey]) == string(data):
		return nil
	default:
		current.Data = secret.Data
		if _, err := secrets.Update(ctx, current, metav1.UpdateOptions{}); err != nil {
			return err
		}
	}
	c.s.log.printf("capi", kcp.GetNamespace()+"/"+cluster, "kubeconfig", "Secret %s written from %s key %s", name, source, key)
	return nil
}

// reconcileBootstrap is CABPT's reconcile of a TalosConfig.
func (c *cozyCAPI) reconcileBootstrap(ctx context.Context, tc *unstructured.Unstructured) error {
	if tc.GetDeletionTimestamp() != nil {
		return nil
	}
	if name, _, _ := unstructured.NestedString(tc.Object, "status", "dataSecretName"); name != "" {
		return nil
	}
	ns, machine := tc.GetNamespace(), ownerOfKind(tc, "Machine")
	if machine == "" {
		// The Machine controller sets the owner (and requeues us).
		return nil
	}
	cluster := tc.GetLabels()[capiClusterNameLabel]
	name := machine + cabptDataSecretSuffix
	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: ns,
			Labels: map[string]string{capiClusterNameLabel: cluster},
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: tc.GetAPIVersion(), Kind: tc.GetKind(), Name: tc.GetName(), UID: tc.GetUID(),
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true),
			}},
		},
		Data: map[string][]byte{"value": []byte("# a Talos worker's machine configuration (played: nothing boots it)\n")},
	}
	if _, err := c.s.mgmt.CoreV1().Secrets(ns).Create(ctx, secret, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	if err := c.mergePatch(ctx, gvrTalosConfig, ns, tc.GetName(), map[string]any{"status": map[string]any{"ready": true, "dataSecretName": name}}, "status"); err != nil {
		return err
	}
	c.s.log.printf("capi", ns+"/"+cluster, "bootstrap", "TalosConfig %s: data Secret %s for Machine %s", tc.GetName(), name, machine)
	return nil
}

// reconcileMachine is CAPK's reconcile of a KubevirtMachine.
func (c *cozyCAPI) reconcileMachine(ctx context.Context, m *unstructured.Unstructured) error {
	ns, name := m.GetNamespace(), m.GetName()
	cluster := m.GetLabels()[capiClusterNameLabel]
	key := ns + "/" + cluster
	vmNS, _, _ := unstructured.NestedString(m.Object, "spec", "virtualMachineTemplate", "metadata", "namespace")
	if vmNS == "" {
		vmNS = ns
	}
	vms := c.s.dyn.Resource(gvrVM).Namespace(vmNS)
	api := c.s.dyn.Resource(gvrKubevirtMachine).Namespace(ns)
	vm, hasVM, watching := c.vms.get(vmNS, name)
	if !watching {
		return fmt.Errorf("KubevirtMachine %s/%s: VirtualMachines not watched yet", ns, name)
	}
	if m.GetDeletionTimestamp() != nil {
		if !slices.Contains(m.GetFinalizers(), capkMachineFinalizer) {
			return nil
		}
		if hasVM && vm.GetDeletionTimestamp() == nil {
			if err := vms.Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				return fmt.Errorf("delete VirtualMachine %s/%s: %w", vmNS, name, err)
			}
			c.s.log.printf("capi", key, "vm-deleted", "KubevirtMachine %s deleted: VirtualMachine %s/%s deleted", name, vmNS, name)
		}
		if removed, err := removeFinalizerDynamic(ctx, api, name, m.GetUID(), capkMachineFinalizer); err != nil {
			return err
		} else if removed {
			c.s.log.printf("capi", key, "finalizer-removed", "KubevirtMachine %s: %s removed", name, capkMachineFinalizer)
		}
		return nil
	}
	machine := ownerOfKind(m, "Machine")
	if machine == "" || cluster == "" {
		// "Waiting for Machine Controller to set OwnerRef on KubevirtMachine"
		return nil
	}
	owner, err := c.s.dyn.Resource(gvrMachineV1beta1).Namespace(ns).Get(ctx, machine, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("the KubevirtMachine's Machine %s/%s: %w", ns, machine, err)
	}
	if data, _, _ := unstructured.NestedString(owner.Object, "spec", "bootstrap", "dataSecretName"); data == "" {
		// "Waiting for the Bootstrap provider controller to set bootstrap data"; the Machine's update requeues nothing here, so look again.
		c.q.AddAfter(capiKey{gvrKubevirtMachine, ns, name}, time.Second)
		return nil
	}
	if err := addFinalizerDynamic(ctx, api, m, capkMachineFinalizer); err != nil {
		return err
	}
	if !hasVM {
		if err := c.createVM(ctx, m, vmNS, cluster); err != nil {
			return err
		}
		c.s.log.printf("capi", key, "vm", "KubevirtMachine %s: VirtualMachine %s/%s created", name, vmNS, name)
	}
	want := capkProviderIDScheme + name
	if id, _, _ := unstructured.NestedString(m.Object, "spec", "providerID"); id != want {
		if err := c.mergePatch(ctx, gvrKubevirtMachine, ns, name, map[string]any{"spec": map[string]any{"providerID": want}}, ""); err != nil {
			return err
		}
	}
	if ready, _, _ := unstructured.NestedBool(m.Object, "status", "ready"); !ready {
		if err := c.mergePatch(ctx, gvrKubevirtMachine, ns, name, map[string]any{"status": map[string]any{"ready": true}}, "status"); err != nil {
			return err
		}
		c.s.log.printf("capi", key, "machine", "KubevirtMachine %s ready: providerID %s", name, want)
	}
	return nil
}

// createVM makes the KubevirtMachine's VirtualMachine from its template,
// labelled as CAPK labels it (utils.go newVirtualMachineFromKubevirtMachine).
func (c *cozyCAPI) createVM(ctx context.Context, m *unstructured.Unstructured, ns, cluster string) error {
	name := m.GetName()
	template, _, _ := unstructured.NestedMap(m.Object, "spec", "virtualMachineTemplate", "spec")
	if template == nil {
		template = map[string]any{}
	}
	vmLabels := map[string]any{"kubevirt.io/vm": name, "name": name, "cluster.x-k8s.io/role": "worker", capiClusterNameLabel: cluster,
		capkMachineNameLabel: name, capkMachineNamespaceLabel: m.GetNamespace()}
	if l, _, _ := unstructured.NestedStringMap(m.Object, "spec", "virtualMachineTemplate", "metadata", "labels"); l != nil {
		for k, v := range l {
			if _, ok := vmLabels[k]; !ok {
				vmLabels[k] = v
			}
		}
	}
	spec := map[string]any{"runStrategy": "Always", "template": map[string]any{"spec": map[string]any{
		"domain": map[string]any{"devices": map[string]any{"disks": []any{}}}, "volumes": []any{},
	}}}
	if rs, ok := template["runStrategy"]; ok {
		spec["runStrategy"] = rs
	}
	vm := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
		"metadata": map[string]any{"name": name, "namespace": ns, "labels": vmLabels},
		"spec":     spec,
	}}
	if _, err := c.s.dyn.Resource(gvrVM).Namespace(ns).Create(ctx, vm, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create VirtualMachine %s/%s: %w", ns, name, err)
	}
	return nil
}

// mergePatch merge-patches an object (or its subresource).
func (c *cozyCAPI) mergePatch(ctx context.Context, gvr schema.GroupVersionResource, ns, name string, patch map[string]any, subresource string) error {
	b, err := json.Marshal(patch)
	if err != nil {
		return err
	}
	var subs []string
	if subresource != "" {
		subs = []string{subresource}
	}
	_, err = c.s.dyn.Resource(gvr).Namespace(ns).Patch(ctx, name, types.MergePatchType, b, metav1.PatchOptions{}, subs...)
	return err
}

// nodeOf names the VM that is Cozystack tenant ns/r's node: that of a
// KubevirtMachine of the cluster, not being deleted, whose VM exists and
// is not being deleted (the first by name if several); or why there is
// none.
func (c *cozyCAPI) nodeOf(ns, r string) (vm string, why string) {
	if c == nil {
		return "", "no Cluster API providers are played"
	}
	machines := c.machines.list(ns, labels.SelectorFromSet(labels.Set{capiClusterNameLabel: r}))
	slices.SortFunc(machines, func(a, b *unstructured.Unstructured) int {
		if a.GetName() < b.GetName() {
			return -1
		}
		return 1
	})
	why = fmt.Sprintf("no KubevirtMachine of Cluster %s: it has no worker node", r)
	for _, m := range machines {
		if m.GetDeletionTimestamp() != nil {
			why = fmt.Sprintf("KubevirtMachine %s is being deleted: its VM and node go", m.GetName())
			continue
		}
		vmNS, _, _ := unstructured.NestedString(m.Object, "spec", "virtualMachineTemplate", "metadata", "namespace")
		if vmNS == "" {
			vmNS = ns
		}
		v, ok, _ := c.vms.get(vmNS, m.GetName())
		switch {
		case !ok:
			why = fmt.Sprintf("KubevirtMachine %s has no VirtualMachine yet", m.GetName())
		case v.GetDeletionTimestamp() != nil:
			why = fmt.Sprintf("VirtualMachine %s/%s is being deleted: the node goes with it", vmNS, m.GetName())
		default:
			return m.GetName(), ""
		}
	}
	return "", why
}
