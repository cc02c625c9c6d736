package main

// The simulator stands in for what a Cozystack installation has and this
// machine lacks: the hypervisor's storage, the storage side of the tenant's
// CSI driver (its controller plugin; Kubernetes' own external-provisioner
// and external-attacher run beside it as child processes), a kubelet, the
// management node that runs the Pods of Jobs (the tenant chart's pre-delete
// hook, which the real helm-controller creates), and the part of Kamaji
// that stops a tenant API server. It drives the real API servers that
// `harness up` runs, so the tests see real finalizers, real garbage
// collection, real attach and detach, and real admission. Flux is not
// simulated: the tests run the real helm-controller (tests/flux/build.sh).
//
//	sim.go          flags, log, management informers, tenant registry
//	sim_storage.go  the storage ledger (one file per volume)
//	sim_tenant.go   per-tenant connection: admin kubeconfig, /readyz, workers
//	sim_driver.go   a provisioner: the plugin, its sidecars, the ledger backend
//	sim_csi.go      the CSI controller plugin (gRPC) and the sidecars' processes
//	sim_kcsi.go     the KubeVirt driver controller's identity (R-kcsi's token)
//	sim_snapshot.go VolumeSnapshots, when the tenant serves that API
//	sim_kubelet.go  the fake Node "sim-node" and its Pods
//	sim_attach.go   the kubelet's part of attach: CSINode, WaitForAttach, volumesInUse
//	sim_jobs.go     the management cluster's Job Pods (real hooks) run locally
//	sim_kamaji.go   TenantControlPlane deleted -> tenant API server stopped
//	sim_capi.go     Cluster API's infrastructure and control plane providers, played
//	sim_cozystack_capi.go  Cozystack's Cluster API providers (Kamaji's, CAPK, CABPT), played
//	sim_infra.go    the infra layer: DataVolumes, CDI, the management storage, VM attachments

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
)

// Names of the components the simulator plays (Flux, Kamaji) and of the
// harness; the platform's names come from the profile (sim_profile.go).
const (
	kamajiFinalizer = "finalizer.kamaji.clastix.io"
	// annHarnessCluster on a TenantControlPlane names the harness cluster
	// that serves as that tenant's API server.
	annHarnessCluster = "harness.volume-gate.test/cluster"
	// annDriverStopped on R-csi ("stopped") stops that tenant's driver.
	annDriverStopped = "harness.volume-gate.test/driver"
	// annFreeAfter on R-csi (a duration, "2m") makes that tenant's driver
	// slow: it frees a released volume no sooner than that after it saw it
	// released, as a slow storage backend does. With the suffix " serially"
	// ("6s serially") it frees one volume at a time, each taking that long,
	// as a backend that serializes its storage operations does.
	annFreeAfter = "harness.volume-gate.test/free-after"
	// annNode on the parent HelmRelease ("down") stops that tenant's
	// kubelet for good, as a node whose VM died: no more heartbeats, so the
	// node goes NotReady, and nothing finishes its Pods.
	annNode = "harness.volume-gate.test/node"
)

var (
	gvrHelmRelease = schema.GroupVersionResource{Group: "helm.toolkit.fluxcd.io", Version: "v2", Resource: "helmreleases"}
	gvrKCP         = schema.GroupVersionResource{Group: "controlplane.cluster.x-k8s.io", Version: "v1alpha1", Resource: "kamajicontrolplanes"}
	gvrTCP         = schema.GroupVersionResource{Group: "kamaji.clastix.io", Version: "v1alpha1", Resource: "tenantcontrolplanes"}
	gvrDataVolume  = schema.GroupVersionResource{Group: "cdi.kubevirt.io", Version: "v1beta1", Resource: "datavolumes"}
	gvrDeployment  = schema.GroupVersionResource{Group: "apps", Version: "v1", Resource: "deployments"}
)

type simConfig struct {
	profile       string
	runJobs       bool              // run the Pods of Jobs in the management cluster (the real hook, under real Flux)
	jobsDir       string            // where those Pods' scripts run; default a new temporary directory
	imageBinaries map[string]string // image repository -> a program of this machine that a Job Pod in that image runs
	management    string
	storage       string
	control       string
	driver        string
	sidecars      string // directory of csi-provisioner and csi-attacher (tests/csi/build.sh)
	sidecarLogs   string // where their logs go; default the run directory
	runDir        string // the plugins' sockets and the sidecars' kubeconfigs; default a new temporary directory
	graceCap      time.Duration
	probeInterval time.Duration
	heartbeat     time.Duration
	namespaces    map[string]bool // empty: every namespace
	nodeIP        string          // the management cluster's real node's IP (up --node), if it has one
}

func runSim(args []string) int {
	cfg, err := parseSimFlags(args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 2
		}
		fmt.Fprintf(os.Stderr, "harness sim: %v\n", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := simMain(ctx, cfg, newSimLog(os.Stdout)); err != nil {
		fmt.Fprintf(os.Stderr, "harness sim: %v\n", err)
		return 1
	}
	return 0
}

func parseSimFlags(args []string) (simConfig, error) {
	// os.Args[0] is the component name; tolerate it being passed along.
	if len(args) > 0 && args[0] == "sim" {
		args = args[1:]
	}
	fs := flag.NewFlagSet("sim", flag.ContinueOnError)
	var cfg simConfig
	var nss names
	fs.StringVar(&cfg.profile, "profile", "", "volume-gate's profile as JSON (`volume-gate profile` prints it): the platform's names (required)")
	fs.StringVar(&cfg.nodeIP, "node-ip", "", "the IP of the management cluster's real node (harness up --node), whose API server routes to endpoints: virt-api then listens on it, registered by an EndpointSlice (endpoint routing has no ExternalName)")
	fs.BoolVar(&cfg.runJobs, "run-jobs", false, "run the Pods of Jobs in the management cluster (a chart's hooks) as local shell processes on node "+jobsNodeName)
	var imageBinaries names
	fs.Var(&imageBinaries, "image-binary", "REPOSITORY=PATH (repeatable): a Job Pod whose image is REPOSITORY (any tag or digest) runs PATH with the container's command and arguments as a local process, as that image's entrypoint would (volume-gate's own image: the binary the tests built)")
	fs.StringVar(&cfg.jobsDir, "jobs-dir", "", "directory (created if missing) where --run-jobs runs the Pods' scripts; default a new temporary directory, removed when the simulator stops")
	fs.StringVar(&cfg.management, "management", "", "kubeconfig of the management cluster (required)")
	fs.StringVar(&cfg.storage, "storage", "", "directory of the storage ledger: one file per volume (required)")
	fs.StringVar(&cfg.control, "control", "", "URL of the harness control API, to stop a tenant API server when its TenantControlPlane is deleted (required)")
	fs.StringVar(&cfg.driver, "driver", "csi.volume-gate.test", "CSI driver name to simulate")
	fs.StringVar(&cfg.sidecars, "sidecars", "", "directory holding Kubernetes' CSI sidecars csi-provisioner and csi-attacher (tests/csi/build.sh prints it) (required)")
	fs.StringVar(&cfg.sidecarLogs, "sidecar-logs", "", "directory for the sidecars' logs, one file per sidecar and provisioner (default: the simulator's run directory)")
	fs.StringVar(&cfg.runDir, "run-dir", "", "directory (created if missing; its path at most 60 bytes, for unix sockets) for the CSI plugins' sockets and the sidecars' kubeconfigs; default a new temporary directory, removed when the simulator stops")
	fs.DurationVar(&cfg.graceCap, "grace-cap", 5*time.Second, "longest termination grace period the kubelet honours")
	fs.DurationVar(&cfg.probeInterval, "probe-interval", 2*time.Second, "how often each tenant API is asked /readyz")
	fs.DurationVar(&cfg.heartbeat, "heartbeat", 10*time.Second, "how often the kubelet renews its Lease and Ready condition")
	fs.Var(&nss, "namespace", "tenant namespace to simulate (repeatable; default: every namespace)")
	if _, err := parseArgs(fs, args, 0); err != nil {
		return cfg, err
	}
	for flagName, v := range map[string]string{"--profile": cfg.profile, "--management": cfg.management, "--storage": cfg.storage, "--control": cfg.control, "--sidecars": cfg.sidecars} {
		if v == "" {
			return cfg, fmt.Errorf("%s is required", flagName)
		}
	}
	if cfg.graceCap < 0 || cfg.probeInterval <= 0 || cfg.heartbeat <= 0 {
		return cfg, errors.New("durations must be positive")
	}
	for _, bin := range []string{"csi-provisioner", "csi-attacher"} {
		if st, err := os.Stat(filepath.Join(cfg.sidecars, bin)); err != nil || st.IsDir() {
			return cfg, fmt.Errorf("--sidecars %s holds no %s: build them with tests/csi/build.sh", cfg.sidecars, bin)
		}
	}
	cfg.sidecars = absPath(cfg.sidecars)
	if cfg.runDir != "" {
		// A socket's path (run dir + /d<number>/csi.sock) must fit in sun_path.
		if cfg.runDir = absPath(cfg.runDir); len(cfg.runDir) > 60 {
			return cfg, fmt.Errorf("--run-dir %s: longer than 60 bytes, too long for the unix sockets under it; pick a shorter one", cfg.runDir)
		}
	}
	cfg.control = strings.TrimRight(cfg.control, "/")
	cfg.namespaces = map[string]bool{}
	for _, ns := range nss {
		cfg.namespaces[ns] = true
	}
	cfg.imageBinaries = map[string]string{}
	for _, ib := range imageBinaries {
		repo, path, ok := strings.Cut(ib, "=")
		if !ok || repo == "" || path == "" {
			return cfg, fmt.Errorf("--image-binary %q: want REPOSITORY=PATH", ib)
		}
		if st, err := os.Stat(path); err != nil || st.IsDir() {
			return cfg, fmt.Errorf("--image-binary %s: %s is not a program", ib, path)
		}
		cfg.imageBinaries[repo] = absPath(path)
	}
	return cfg, nil
}

// simLog writes one line per action: `time component tenant action details`,
// so a person can follow a teardown with `tail -f`.
type simLog struct {
	mu sync.Mutex
	w  io.Writer
}

func newSimLog(w io.Writer) *simLog { return &simLog{w: w} }

// printf logs an action. tenant is "namespace/release", or "-".
func (l *simLog) printf(component, tenant, action, format string, args ...any) {
	if tenant == "" {
		tenant = "-"
	}
	// One action, one line: multi-line errors (errors.Join) are folded.
	details := strings.ReplaceAll(fmt.Sprintf(format, args...), "\n", "; ")
	line := fmt.Sprintf("%s %-7s %s %s %s", time.Now().UTC().Format("2006-01-02T15:04:05.000Z"), component, tenant, action, details)
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Fprintln(l.w, strings.TrimRight(line, " "))
}

// sim is the whole simulator: management-cluster clients and informers, the
// ledger, and one worker per tenant.
type sim struct {
	cfg   simConfig
	log   *simLog
	store *storage
	mgmt  kubernetes.Interface
	dyn   dynamic.Interface
	// restCfg is the management API's, for clients made with other credentials.
	restCfg *rest.Config
	disc    discovery.DiscoveryInterface

	hrs  *lazyInformer // HelmReleases; started once the CRD is served
	tcps *lazyInformer // TenantControlPlanes; likewise
	// deploys are the management Deployments (infra layer only): a
	// tenant's CSI controller runs while R-kcsi-controller exists.
	deploys *lazyInformer

	// csiRun holds the plugins' unix sockets (short paths: a socket path
	// has at most 107 bytes) and the sidecars' kubeconfigs.
	csiRun string

	jobs   *jobs
	kamaji *kamaji
	capi   *capiWorld
	cozy   *cozyCAPI

	ctx     context.Context
	mu      sync.Mutex
	tenants map[string]*tenant // by id: "namespace/release", or capiTenantID
	wg      sync.WaitGroup
}

// simMain runs the simulator until ctx ends.
func simMain(ctx context.Context, cfg simConfig, l *simLog) error {
	var err error
	if prof, err = loadProfile(cfg.profile); err != nil {
		return err
	}
	restCfg, err := clientcmd.BuildConfigFromFlags("", cfg.management)
	if err != nil {
		return fmt.Errorf("management kubeconfig: %w", err)
	}
	restCfg.QPS, restCfg.Burst = 50, 100
	restCfg.UserAgent = "volume-gate-sim"
	// API warnings (e.g. about finalizer names in test fixtures) are noise here.
	restCfg.WarningHandler = rest.NoWarnings{}
	mgmt, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		return err
	}
	dyn, err := dynamic.NewForConfig(restCfg)
	if err != nil {
		return err
	}
	store, err := openStorage(cfg.storage, l)
	if err != nil {
		return err
	}
	csiRun := cfg.runDir
	if csiRun == "" {
		if csiRun, err = os.MkdirTemp("", "vg-csi-"); err != nil {
			return err
		}
		defer os.RemoveAll(csiRun)
	} else if err := os.MkdirAll(csiRun, 0o700); err != nil {
		return fmt.Errorf("--run-dir: %w", err)
	}
	if cfg.sidecarLogs == "" {
		cfg.sidecarLogs = csiRun
	} else if err := os.MkdirAll(cfg.sidecarLogs, 0o755); err != nil {
		return fmt.Errorf("--sidecar-logs: %w", err)
	}
	s := &sim{
		cfg: cfg, log: l, store: store, mgmt: mgmt, dyn: dyn, restCfg: restCfg, disc: mgmt.Discovery(),
		ctx: ctx, tenants: map[string]*tenant{}, csiRun: csiRun,
	}
	if s.cfg.runJobs {
		if s.jobs, err = newJobs(s); err != nil {
			return err
		}
	}
	s.kamaji = newKamaji(s)
	scope := "every namespace"
	if len(cfg.namespaces) > 0 {
		scope = "namespaces " + strings.Join(slices.Sorted(maps.Keys(cfg.namespaces)), ",")
	}
	layers := "one layer (the tenant driver's disks in the ledger)"
	if prof.infra != nil {
		layers = "infra layer (tenant volumes are DataVolumes; the management storage's disks in the ledger)"
	}
	s.log.printf("sim", "", "start", "management=%s storage=%s driver=%s scope=%q grace-cap=%s run-jobs=%t storage-model=%q",
		restCfg.Host, store.dir, cfg.driver, scope, cfg.graceCap, cfg.runJobs, layers)

	factory := dynamicinformer.NewDynamicSharedInformerFactory(dyn, 0)
	s.hrs = newLazyInformer(s, factory, gvrHelmRelease, cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { s.onHelmRelease(obj) },
		UpdateFunc: func(_, obj any) { s.onHelmRelease(obj) },
		DeleteFunc: func(obj any) { s.onHelmRelease(tombstone(obj)) },
	})
	s.tcps = newLazyInformer(s, factory, gvrTCP, cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { s.onTCP(obj, false) },
		UpdateFunc: func(_, obj any) { s.onTCP(obj, false) },
		DeleteFunc: func(obj any) { s.onTCP(tombstone(obj), true) },
	})
	if prof.infra != nil {
		kick := func(obj any) {
			if d, ok := tombstone(obj).(*unstructured.Unstructured); ok {
				if r, ok := strings.CutSuffix(d.GetName(), kcsiControllerSuffix); ok {
					s.kickTenant(d.GetNamespace(), r)
				}
				// A played Cluster API cluster's management-side controller.
				s.kickCAPIIn(d.GetNamespace())
			}
		}
		s.deploys = newLazyInformer(s, factory, gvrDeployment, cache.ResourceEventHandlerFuncs{
			AddFunc: kick, UpdateFunc: func(_, obj any) { kick(obj) }, DeleteFunc: kick,
		})
		s.wg.Go(func() { s.deploys.run(ctx) })
		s.startInfra(ctx, factory)
	}
	s.startCAPI(ctx, factory)
	s.startCozystackCAPI(ctx, factory)
	// Each informer starts once its CRD is served; a tenant worker consults
	// both caches on every round, so the order they start in does not matter.
	s.wg.Go(func() { s.tcps.run(ctx) })
	s.wg.Go(func() { s.hrs.run(ctx) })
	if s.jobs != nil {
		s.wg.Go(func() { s.jobs.run(ctx) })
	}
	if s.jobs != nil || prof.infra != nil {
		s.wg.Go(func() { s.runManagementNode(ctx) })
	}

	<-ctx.Done()
	s.log.printf("sim", "", "stop", "signal received; stopping tenant workers")
	s.wg.Wait()
	s.log.printf("sim", "", "stopped", "")
	return nil
}

// inScope reports whether namespace ns is simulated.
func (s *sim) inScope(ns string) bool {
	return len(s.cfg.namespaces) == 0 || s.cfg.namespaces[ns]
}

// isParent reports whether a HelmRelease is a tenant Kubernetes cluster.
func isParent(hr *unstructured.Unstructured) bool {
	l := hr.GetLabels()
	for k, v := range prof.parentLabels {
		if l[k] != v {
			return false
		}
	}
	return true
}

func (s *sim) onHelmRelease(obj any) {
	hr, ok := obj.(*unstructured.Unstructured)
	if !ok || !s.inScope(hr.GetNamespace()) {
		return
	}
	ns := hr.GetNamespace()
	if isParent(hr) {
		s.ensureTenant(ns, hr.GetName())
	}
	// A child release (R-csi above all) decides whether R's driver runs.
	if target := hr.GetLabels()[prof.childLabel]; target != "" {
		s.kickTenant(ns, target)
	}
	if r, ok := strings.CutSuffix(hr.GetName(), prof.csiSuffix); ok {
		s.kickTenant(ns, r)
	}
}

func (s *sim) onTCP(obj any, deleted bool) {
	tcp, ok := obj.(*unstructured.Unstructured)
	if !ok || !s.inScope(tcp.GetNamespace()) {
		return
	}
	if deleted || tcp.GetDeletionTimestamp() != nil {
		s.kamaji.controlPlaneDeleted(tcp)
	} else {
		s.kamaji.controlPlanePresent(tcp)
		s.ensureTenant(tcp.GetNamespace(), tcp.GetName())
		// Kamaji's provider owns it and watches it.
		if s.cozy != nil {
			s.cozy.q.Add(capiKey{gvrKCP, tcp.GetNamespace(), tcp.GetName()})
		}
	}
	s.kickTenant(tcp.GetNamespace(), tcp.GetName())
}

// ensureTenant starts the worker for Cozystack tenant ns/name unless it runs.
func (s *sim) ensureTenant(ns, name string) {
	s.ensureTenantOf(newTenant(s, ns, name))
}

// ensureCAPITenant starts the worker for played Cluster API cluster
// ns/name unless it runs.
func (s *sim) ensureCAPITenant(ns, name string) {
	t := newTenant(s, ns, name)
	t.capi, t.id = true, capiTenantID(ns, name)
	s.ensureTenantOf(t)
}

// ensureTenantOf starts t's worker unless one with its id runs.
func (s *sim) ensureTenantOf(t *tenant) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ctx.Err() != nil {
		return
	}
	if running := s.tenants[t.id]; running != nil {
		running.kickNow()
		return
	}
	s.tenants[t.id] = t
	s.wg.Go(func() { t.run(s.ctx) })
}

func (s *sim) kickTenant(ns, name string) { s.kickTenantID(ns + "/" + name) }

func (s *sim) kickTenantID(id string) {
	s.mu.Lock()
	t := s.tenants[id]
	s.mu.Unlock()
	if t != nil {
		t.kickNow()
	}
}

// hasTenant reports whether a tenant worker with this id runs.
func (s *sim) hasTenant(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.tenants[id] != nil
}

// tenantExited removes t from the registry unless something brought it back
// in the meantime; it reports whether t may exit.
func (s *sim) tenantExited(t *tenant) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if t.wanted() && s.ctx.Err() == nil {
		return false
	}
	if s.tenants[t.id] == t {
		delete(s.tenants, t.id)
	}
	return true
}

// lazyInformer is a management-cluster informer for a custom resource that
// may not be served yet: it waits (discovery, every few seconds) for the
// CRD, then lists and watches. Tests install CRDs after starting the sim.
type lazyInformer struct {
	s       *sim
	factory dynamicinformer.DynamicSharedInformerFactory
	gvr     schema.GroupVersionResource
	handler cache.ResourceEventHandler

	mu     sync.Mutex
	lister cache.GenericLister // nil until the resource is served
}

func newLazyInformer(s *sim, f dynamicinformer.DynamicSharedInformerFactory, gvr schema.GroupVersionResource, h cache.ResourceEventHandler) *lazyInformer {
	return &lazyInformer{s: s, factory: f, gvr: gvr, handler: h}
}

func (li *lazyInformer) run(ctx context.Context) {
	if !waitServed(ctx, li.s, li.gvr) {
		return
	}
	inf := li.factory.ForResource(li.gvr)
	// The lister is published before the informer starts: event handlers
	// (which run after the cache holds the object) look objects up in it.
	li.mu.Lock()
	li.lister = inf.Lister()
	li.mu.Unlock()
	if _, err := inf.Informer().AddEventHandler(li.handler); err != nil {
		li.s.log.printf("sim", "", "error", "watch %s: %v", li.gvr.Resource, err)
		return
	}
	li.factory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), inf.Informer().HasSynced) {
		return
	}
	li.s.log.printf("sim", "", "watching", "%s", li.gvr.GroupResource())
}

// get returns the cached object, whether it exists, and whether the cache
// is running at all (the CRD may not be installed).
func (li *lazyInformer) get(ns, name string) (obj *unstructured.Unstructured, exists, running bool) {
	li.mu.Lock()
	lister := li.lister
	li.mu.Unlock()
	if lister == nil {
		return nil, false, false
	}
	o, err := lister.ByNamespace(ns).Get(name)
	if err != nil {
		return nil, false, true
	}
	return o.(*unstructured.Unstructured), true, true
}

// list returns the cached objects of namespace ns matching sel; none while
// the cache is not running.
func (li *lazyInformer) list(ns string, sel labels.Selector) []*unstructured.Unstructured {
	li.mu.Lock()
	lister := li.lister
	li.mu.Unlock()
	if lister == nil {
		return nil
	}
	objs, err := lister.ByNamespace(ns).List(sel)
	if err != nil {
		return nil
	}
	out := make([]*unstructured.Unstructured, 0, len(objs))
	for _, o := range objs {
		out = append(out, o.(*unstructured.Unstructured))
	}
	return out
}

// waitServed blocks until the API server serves gvr; it logs once while it
// waits. It returns false if ctx ends first.
func waitServed(ctx context.Context, s *sim, gvr schema.GroupVersionResource) bool {
	logged := false
	for {
		served, err := resourceServed(s.disc, gvr)
		if served {
			return true
		}
		if !logged {
			why := "CRD not installed"
			if err != nil {
				why = err.Error()
			}
			s.log.printf("sim", "", "waiting", "for %s to be served (%s)", gvr.GroupResource(), why)
			logged = true
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(2 * time.Second):
		}
	}
}

// resourceServed asks discovery whether gvr is served. A group/version that
// is not served at all is (false, nil): an absent API is not an error.
func resourceServed(d discovery.DiscoveryInterface, gvr schema.GroupVersionResource) (bool, error) {
	list, err := d.ServerResourcesForGroupVersion(gvr.GroupVersion().String())
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	for _, r := range list.APIResources {
		if r.Name == gvr.Resource {
			return true, nil
		}
	}
	return false, nil
}

func tombstone(obj any) any {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		return t.Obj
	}
	return obj
}

// withoutFinalizer builds a JSON patch that removes finalizer f, guarded by
// a test of the current list so a concurrent change makes it fail (and the
// caller retries) instead of dropping someone else's finalizer.
func withoutFinalizer(current []string, f string) ([]byte, bool) {
	if !slices.Contains(current, f) {
		return nil, false
	}
	keep := slices.DeleteFunc(slices.Clone(current), func(s string) bool { return s == f })
	patch := []map[string]any{
		{"op": "test", "path": "/metadata/finalizers", "value": current},
		{"op": "replace", "path": "/metadata/finalizers", "value": keep},
	}
	b, err := json.Marshal(patch)
	if err != nil {
		return nil, false
	}
	return b, true
}

// removeFinalizerDynamic removes finalizer f from a custom object, reading
// it fresh. It reports whether it removed anything.
func removeFinalizerDynamic(ctx context.Context, c dynamic.ResourceInterface, name string, uid types.UID, f string) (bool, error) {
	obj, err := c.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if uid != "" && obj.GetUID() != uid {
		return false, nil
	}
	patch, ok := withoutFinalizer(obj.GetFinalizers(), f)
	if !ok {
		return false, nil
	}
	_, err = c.Patch(ctx, name, types.JSONPatchType, patch, metav1.PatchOptions{})
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	return err == nil, err
}

// tenantRESTConfig parses an admin kubeconfig (from the Secret) into a
// client configuration with short timeouts: the tenant API may be stopped
// at any moment, and nothing must hang on it.
func tenantRESTConfig(kubeconfig []byte) (*rest.Config, error) {
	cfg, err := clientcmd.RESTConfigFromKubeConfig(kubeconfig)
	if err != nil {
		return nil, err
	}
	cfg.QPS, cfg.Burst = 200, 400
	cfg.Timeout = 15 * time.Second
	cfg.UserAgent = "volume-gate-sim"
	cfg.WarningHandler = rest.NoWarnings{}
	return cfg, nil
}

// absPath makes the storage directory absolute, for the log and the ledger.
func absPath(p string) string {
	if a, err := filepath.Abs(p); err == nil {
		return a
	}
	return p
}
