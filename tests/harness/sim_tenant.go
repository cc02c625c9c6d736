package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
)

// tenant follows one tenant cluster R in namespace N: it connects to the
// tenant API with the admin kubeconfig Secret, asks it /readyz, and runs the
// kubelet while the API answers and the CSI driver while, in addition, the
// driver's release R-csi exists and is not being deleted.
//
// A tenant lives while its parent HelmRelease or its TenantControlPlane
// exists in the management cluster. A played Cluster API cluster's tenant
// (capi, sim_capi.go) lives while its Cluster exists; it connects with the
// Secret <cluster>-kubeconfig, and its node and CSI driver run while one
// of its HarnessMachines does.
type tenant struct {
	s        *sim
	ns, name string
	key      string // "N/R", the tenant column of the log
	id       string // the registry's key: key, or capiTenantID
	capi     bool
	kick     chan struct{}

	// Owned by the run goroutine.
	server string
	// kubeconfig is the admin kubeconfig Secret's content the client was
	// made from, for the driver's sidecars.
	kubeconfig []byte
	client     kubernetes.Interface
	dyn        dynamic.Interface
	apiUp      bool
	problem    string // last reason logged for the API being unusable
	// failures counts the probes in a row that found the API not ready.
	failures int
	kubelet  *worker
	driver   *worker
	// vm is the VirtualMachine of the Cozystack tenant's machine, its node
	// (sim_cozystack_capi.go); "" while it has none.
	vm string

	// driverActive is read by the kubelet: mounting a volume needs the
	// driver's node plugin, which goes away with the driver release.
	driverActive atomic.Bool

	// kcsi is the CSI controller's identity in the management cluster.
	kcsi kcsiIdentity
	// kcsiPod* is the last look at the CSI controller's Pod (real node).
	kcsiPodMu  sync.Mutex
	kcsiPodAt  time.Time
	kcsiPodOK  bool
	kcsiPodWhy string
	// freeAfterSeen is the driver's slowness last logged.
	freeAfterSeen slowness

	// csiController is a played Cluster API cluster's management-side CSI
	// controller Deployment, once its HarnessCluster named one (kept: the
	// shape is the cluster's); owned by the run goroutine.
	csiController string
	// mgmt is what that controller runs as and labels its disks with, read
	// from its Deployment when the driver last started; nil for every other
	// tenant. Read by the driver's goroutines.
	mgmtMu sync.Mutex
	mgmt   *managementCSI
}

// managementCSI is the management-side CSI controller of a played Cluster
// API cluster, as its Deployment says.
type managementCSI struct {
	deployment     string
	serviceAccount string
	labels         map[string]string
}

func (t *tenant) managementCSI() *managementCSI {
	t.mgmtMu.Lock()
	defer t.mgmtMu.Unlock()
	return t.mgmt
}

func (t *tenant) setManagementCSI(m *managementCSI) {
	t.mgmtMu.Lock()
	defer t.mgmtMu.Unlock()
	t.mgmt = m
}

func newTenant(s *sim, ns, name string) *tenant {
	key := ns + "/" + name
	return &tenant{s: s, ns: ns, name: name, key: key, id: key, kick: make(chan struct{}, 1)}
}

func (t *tenant) logf(component, action, format string, args ...any) {
	t.s.log.printf(component, t.key, action, format, args...)
}

// kickNow asks the worker to re-evaluate soon; it never blocks.
func (t *tenant) kickNow() {
	select {
	case t.kick <- struct{}{}:
	default:
	}
}

// wanted reports whether the management cluster still has this tenant.
func (t *tenant) wanted() bool {
	if t.capi {
		return t.s.capi.wanted(t.ns, t.name)
	}
	if hr, ok, _ := t.s.hrs.get(t.ns, t.name); ok && isParent(hr) {
		return true
	}
	_, ok, _ := t.s.tcps.get(t.ns, t.name)
	return ok
}

func (t *tenant) run(ctx context.Context) {
	t.logf("tenant", "found", "following tenant cluster %s in namespace %s", t.name, t.ns)
	ticker := time.NewTicker(t.s.cfg.probeInterval)
	defer ticker.Stop()
	for {
		if !t.wanted() && t.s.tenantExited(t) {
			t.setWorkers(false, false, "tenant gone from the management cluster", "tenant gone from the management cluster")
			if t.capi {
				t.logf("tenant", "forgotten", "Cluster %s gone", t.name)
			} else {
				t.logf("tenant", "forgotten", "no parent HelmRelease or TenantControlPlane left")
			}
			return
		}
		t.reconcile(ctx)
		select {
		case <-ctx.Done():
			t.setWorkers(false, false, "simulator stopping", "simulator stopping")
			return
		case <-t.kick:
		case <-ticker.C:
		}
	}
}

// probeFailuresBeforeDown is how many probes in a row must fail before an
// API that answered is taken for down, as the kubelet takes a container's
// probe (failureThreshold, default 3): one late answer on a loaded machine
// is not an outage. Stopping the kubelet and the driver on it restarted the
// CSI sidecars, whose start-up lists loaded the machine further: 50 light
// tenants on 2 cores logged 6,947 api-down lines in one run and never
// settled. An API that cannot be reached at all (no kubeconfig, the
// connection refused, its control plane stopped) is down at once.
const probeFailuresBeforeDown = 3

func (t *tenant) reconcile(ctx context.Context) {
	up, why, definite := t.probe(ctx)
	if up {
		t.failures = 0
	} else {
		t.failures++
		if t.apiUp && !definite && t.failures < probeFailuresBeforeDown {
			t.logf("tenant", "api-late", "probe %d of %d failed: %s", t.failures, probeFailuresBeforeDown, why)
			up, why = true, ""
		}
	}
	switch {
	case up && !t.apiUp:
		t.logf("tenant", "api-up", "tenant API %s answers /readyz", t.server)
		t.problem = ""
	case !up && (t.apiUp || why != t.problem):
		t.logf("tenant", "api-down", "%s", why)
		t.problem = why
	}
	t.apiUp = up
	if t.capi {
		t.reconcileCAPI(ctx, up, why)
		return
	}

	if d := t.freeAfter(); d != t.freeAfterSeen {
		t.freeAfterSeen = d
		how := "each"
		if d.serially {
			how = "one at a time, each"
		}
		t.logf("driver", "free-after", "%s: the driver frees released volumes %s %s after it sees it released", annFreeAfter, how, d.delay)
	}
	csiOK, csiWhy := t.csiRelease()
	if csiOK && prof.infra != nil {
		csiOK, csiWhy = t.kcsiController()
	}
	driverWhy := csiWhy
	if !up {
		driverWhy = "tenant API down: " + why
	}
	kubeletOn, kubeletWhy := up, why
	vm, noVM := t.s.cozy.nodeOf(t.ns, t.name)
	if kubeletOn && vm == "" {
		kubeletOn, kubeletWhy = false, noVM
	}
	if down := t.nodeDown(); down != "" {
		kubeletOn, kubeletWhy = false, down
	}
	if t.kubelet != nil && kubeletOn && t.vm != vm {
		// Another machine's VM: the node this kubelet was is gone.
		t.setWorkers(false, t.driver != nil, fmt.Sprintf("its VM %s is no longer the cluster's machine (now %s)", t.vm, vm), "")
	}
	t.vm = vm
	t.setWorkers(kubeletOn, up && csiOK, kubeletWhy, driverWhy)
}

// setWorkers starts or stops the kubelet and the driver; the reasons are
// logged when a worker stops.
func (t *tenant) setWorkers(kubeletOn, driverOn bool, kubeletWhy, driverWhy string) {
	if !driverOn && t.driver != nil {
		t.driverActive.Store(false)
		t.driver.stop()
		t.driver = nil
		t.logf("driver", "deactivated", "%s stopped: %s", t.s.cfg.driver, driverWhy)
	}
	if !kubeletOn && t.kubelet != nil {
		t.kubelet.stop()
		t.kubelet = nil
		t.logf("kubelet", "stopped", "node %s: %s", simNodeName, kubeletWhy)
	}
	// A late probe dropped the client: what runs keeps its own; nothing new
	// starts until the next probe connects again.
	connected := t.client != nil
	if kubeletOn && connected && t.kubelet == nil {
		vm := t.vm
		if t.capi {
			vm = vmName(t.name)
		}
		k := newKubelet(t, t.client, vm)
		t.kubelet = startWorker(t.s.ctx, k.run)
		t.logf("kubelet", "started", "node %s on %s (VM %s)", simNodeName, t.server, vm)
	}
	if driverOn && connected && t.driver == nil {
		d := newDriver(t, t.client, t.dyn, t.kubeconfig)
		t.driver = startWorker(t.s.ctx, d.run)
		t.driverActive.Store(true)
		why := "HelmRelease " + t.name + prof.csiSuffix + " present and tenant API up"
		if m := t.managementCSI(); t.capi && m != nil {
			why = fmt.Sprintf("management-side controller: Deployment %s/%s present, as ServiceAccount %s, DataVolumes labelled %v", t.ns, m.deployment, m.serviceAccount, m.labels)
		} else if t.capi {
			why = "in-tenant controller on node " + simNodeName + " (a HarnessMachine runs it)"
		} else if prof.infra != nil {
			why += "; Deployment " + t.name + kcsiControllerSuffix + " present"
		}
		t.logf("driver", "activated", "%s: %s; external-provisioner started", t.s.cfg.driver, why)
	}
}

// csiRelease reports whether the CSI driver release R-csi is installed:
// present and not being deleted.
func (t *tenant) csiRelease() (bool, string) {
	name := t.name + prof.csiSuffix
	hr, ok, running := t.s.hrs.get(t.ns, name)
	switch {
	case !running:
		return false, "HelmRelease API not served yet"
	case !ok:
		return false, fmt.Sprintf("HelmRelease %s is gone", name)
	case hr.GetDeletionTimestamp() != nil:
		return false, fmt.Sprintf("HelmRelease %s is being deleted", name)
	case hr.GetAnnotations()[annDriverStopped] == "stopped":
		// A driver that is installed but stuck or crashed: tests flip it.
		return false, fmt.Sprintf("driver stopped (annotation %s on HelmRelease %s)", annDriverStopped, name)
	}
	return true, ""
}

// nodeDown says why the tenant's node is down (annNode on the parent), or "".
func (t *tenant) nodeDown() string {
	if hr, ok, _ := t.s.hrs.get(t.ns, t.name); ok && hr.GetAnnotations()[annNode] == "down" {
		return fmt.Sprintf("node down (annotation %s on HelmRelease %s): its kubelet is gone", annNode, t.name)
	}
	return ""
}

// kcsiControllerSuffix names the KubeVirt CSI driver's controller
// Deployment, R-kcsi-controller, a template of the parent release.
const kcsiControllerSuffix = "-kcsi-controller"

// kcsiController reports whether the tenant's CSI controller Deployment
// (infra layer) exists and is not being deleted: its sidecars run while it
// does.
func (t *tenant) kcsiController() (bool, string) {
	return t.controllerDeployment(t.name + kcsiControllerSuffix)
}

// controllerDeployment reports whether the management-side CSI controller
// Deployment `name` exists in the tenant's namespace and is not being
// deleted (and, on a real node, runs a Ready Pod).
func (t *tenant) controllerDeployment(name string) (bool, string) {
	d, ok, running := t.s.deploys.get(t.ns, name)
	switch {
	case !running:
		return false, "Deployment API not watched yet"
	case !ok:
		return false, fmt.Sprintf("the CSI controller Deployment %s/%s is gone", t.ns, name)
	case d.GetDeletionTimestamp() != nil:
		return false, fmt.Sprintf("the CSI controller Deployment %s/%s is being deleted", t.ns, name)
	}
	if replicas, _, _ := unstructured.NestedInt64(d.Object, "spec", "replicas"); t.s.cfg.nodeIP != "" && replicas > 0 {
		return t.kcsiPod(d)
	}
	return true, ""
}

// kcsiPod reports whether the CSI controller Deployment d runs a Pod now,
// on the management cluster's real node: Running, Ready and not being
// deleted. There the Deployment runs a Pod that holds its place (`harness
// pause`), and the simulator's plugin and sidecars for the tenant work
// only while that Pod does, as the real controller's containers would: a
// namespace deletion that deletes the Pod (or its ReplicaSet) stops the
// driver, and a terminating namespace makes no new one. Read at most
// every kcsiCheckTTL.
func (t *tenant) kcsiPod(d *unstructured.Unstructured) (bool, string) {
	t.kcsiPodMu.Lock()
	defer t.kcsiPodMu.Unlock()
	if time.Since(t.kcsiPodAt) < kcsiCheckTTL {
		return t.kcsiPodOK, t.kcsiPodWhy
	}
	t.kcsiPodAt = time.Now()
	t.kcsiPodOK, t.kcsiPodWhy = false, ""
	labels, _, _ := unstructured.NestedStringMap(d.Object, "spec", "selector", "matchLabels")
	ctx, cancel := context.WithTimeout(t.s.ctx, 5*time.Second)
	defer cancel()
	pods, err := t.s.mgmt.CoreV1().Pods(t.ns).List(ctx, metav1.ListOptions{LabelSelector: metav1.FormatLabelSelector(&metav1.LabelSelector{MatchLabels: labels})})
	if err != nil {
		t.kcsiPodWhy = fmt.Sprintf("cannot list the CSI controller's Pods: %v", err)
		return false, t.kcsiPodWhy
	}
	for _, p := range pods.Items {
		if p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning {
			continue
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				t.kcsiPodOK = true
				return true, ""
			}
		}
	}
	t.kcsiPodWhy = fmt.Sprintf("the CSI controller Deployment %s/%s runs no Ready Pod (of %d)", t.ns, d.GetName(), len(pods.Items))
	return false, t.kcsiPodWhy
}

// slowness is how a driver takes its time to free a volume.
type slowness struct {
	// delay per volume; 0: at once.
	delay time.Duration
	// serially: one volume at a time, so the n-th is freed n delays after
	// the first was asked for.
	serially bool
}

// freeAfter is how this tenant's driver takes its time to free a released
// volume: annFreeAfter on R-csi ("6s", "6s serially"); zero when absent or
// not a duration.
func (t *tenant) freeAfter() slowness {
	hr, ok, _ := t.s.hrs.get(t.ns, t.name+prof.csiSuffix)
	if !ok {
		return slowness{}
	}
	v, serially := strings.CutSuffix(hr.GetAnnotations()[annFreeAfter], " serially")
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		return slowness{}
	}
	return slowness{delay: d, serially: serially}
}

// probe connects to the tenant API (once per outage, from the admin
// kubeconfig Secret) and asks it /readyz, bounded by a short timeout.
// definite says the API cannot be reached at all, not only that it
// answered late or not ready.
func (t *tenant) probe(ctx context.Context) (up bool, why string, definite bool) {
	if t.capi && t.s.capi.isStopped(t.ns, t.name) {
		t.client = nil
		return false, "HarnessControlPlane deleted: tenant API server stopped", true
	}
	if !t.capi && t.s.kamaji.isStopped(t.ns, t.name) {
		t.client = nil
		return false, "TenantControlPlane deleted: tenant API server stopped", true
	}
	if t.client == nil {
		if why := t.connect(ctx); why != "" {
			return false, why, true
		}
	}
	pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if _, err := t.client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(pctx); err != nil {
		// Read the Secret again next time: the API may come back elsewhere.
		t.client = nil
		return false, fmt.Sprintf("tenant API %s did not answer /readyz: %v", t.server, err), errors.Is(err, syscall.ECONNREFUSED)
	}
	return true, "", false
}

func (t *tenant) connect(ctx context.Context) string {
	name, keys := t.name+prof.kubeconfigSuffix, prof.kubeconfigKeys
	if t.capi {
		name, keys = t.name+capiKubeconfigSuffix, []string{capiKubeconfigKey}
	}
	gctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	secret, err := t.s.mgmt.CoreV1().Secrets(t.ns).Get(gctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return fmt.Sprintf("no admin kubeconfig: Secret %s not found", name)
	case err != nil:
		return fmt.Sprintf("read Secret %s: %v", name, err)
	}
	var data []byte
	var key string
	for _, k := range keys {
		if data, key = secret.Data[k], k; len(data) > 0 {
			break
		}
	}
	if len(data) == 0 {
		return fmt.Sprintf("Secret %s has none of the keys %s", name, strings.Join(keys, ", "))
	}
	cfg, err := tenantRESTConfig(data)
	if err != nil {
		// Never log the kubeconfig itself.
		return fmt.Sprintf("Secret %s key %s is not a usable kubeconfig: %v", name, key, err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err.Error()
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return err.Error()
	}
	t.client, t.dyn, t.server, t.kubeconfig = client, dyn, cfg.Host, data
	return ""
}

// worker is a goroutine with its own context that can be stopped and
// waited for, so two generations of a kubelet or driver never overlap.
type worker struct {
	cancel context.CancelFunc
	done   chan struct{}
}

func startWorker(parent context.Context, run func(context.Context)) *worker {
	ctx, cancel := context.WithCancel(parent)
	w := &worker{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		run(ctx)
	}()
	return w
}

func (w *worker) stop() {
	w.cancel()
	<-w.done
}
