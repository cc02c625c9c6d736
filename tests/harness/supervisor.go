package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"github.com/cozystack/volume-gate/tests/harness/liveness"
	"io"
	"log"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

const (
	managementCluster = "management"
	// stopGrace is how long a component gets between SIGTERM and SIGKILL.
	stopGrace = 10 * time.Second
	// serviceAccountIssuer is also the only API audience, as on kubeadm clusters.
	serviceAccountIssuer = "https://kubernetes.default.svc.cluster.local"
)

// clusterInfo is DIR/NAME/info.json and the control API's answer.
type clusterInfo struct {
	Name           string            `json:"name"`
	Server         string            `json:"server"`
	Kubeconfig     string            `json:"kubeconfig"`
	EtcdPrefix     string            `json:"etcd_prefix"`
	APIServerPID   int               `json:"apiserver_pid"`
	KCMPID         int               `json:"kcm_pid"`
	SchedulerPID   int               `json:"scheduler_pid,omitempty"`
	CAFile         string            `json:"ca_file"`
	ClientCertFile string            `json:"client_cert_file"`
	ClientKeyFile  string            `json:"client_key_file"`
	Logs           map[string]string `json:"logs"`
	Light          bool              `json:"light,omitempty"`
	Running        bool              `json:"running"`
	// Commands, for a cluster run in Pods (?run=pod), are the command
	// lines of its components, each beginning with the component's name
	// (the harness's first argument), for containers to run with the host's
	// network and the state directory at the same path: the supervisor
	// prepared the cluster (ports, kubeconfig) and runs none of it.
	Commands map[string][]string `json:"commands,omitempty"`

	procs []*proc
}

// proc is one component process started by the supervisor.
type proc struct {
	name     string // e.g. "tenant kube-apiserver"
	logPath  string
	cmd      *exec.Cmd
	done     chan struct{} // closed once the process has been reaped
	stopping atomic.Bool
}

// A light tenant cluster serves only the API groups the volume-release phase,
// the simulated driver and kubelet use, runs only the volume controllers
// (attach/detach among them) and
// the quota controller, and has no scheduler: Pods are created with
// spec.nodeName set to the simulated node. It is about a third of a full
// tenant cluster's memory, so tens of tenants fit on one machine.
const (
	lightAPIs = "api/all=false,api/v1=true,apps/v1=true,storage.k8s.io/v1=true," +
		"coordination.k8s.io/v1=true,rbac.authorization.k8s.io/v1=true," +
		"authentication.k8s.io/v1=true,authorization.k8s.io/v1=true," +
		"apiextensions.k8s.io/v1=true,admissionregistration.k8s.io/v1=true," +
		"events.k8s.io/v1=true,discovery.k8s.io/v1=true,policy/v1=true,scheduling.k8s.io/v1=true," +
		"apiregistration.k8s.io/v1=true,networking.k8s.io/v1=true,node.k8s.io/v1=true"
	lightControllers = "persistentvolume-binder-controller,persistentvolume-protection-controller," +
		"persistentvolume-attach-detach-controller," +
		"persistentvolumeclaim-protection-controller,resourcequota-controller," +
		"serviceaccount-controller,serviceaccount-token-controller"
)

type cluster struct {
	mu   sync.Mutex // serialises starting and stopping
	name string
	// ports are the apiserver, controller manager and scheduler ports; they
	// are reused when the cluster is restarted, so its kubeconfig stays valid.
	ports [3]int
	// light is fixed when the cluster is first started: see lightAPIs.
	light bool
	// pod: its components run in Pods the caller makes (Commands), not here.
	pod   bool
	procs []*proc // apiserver first
	info  atomic.Pointer[clusterInfo]
}

type supervisor struct {
	ctx     context.Context // cancelled on SIGTERM/SIGINT or when the owner is gone
	state   string
	self    string
	timeout time.Duration
	admin   *http.Client // admin client certificate, CA verified
	etcd    *proc
	etcdURL string

	mu        sync.Mutex
	closing   bool
	clusters  map[string]*cluster
	usedPorts map[int]bool

	// withNode: the management cluster gets a real node (node.go).
	withNode bool
	node     *node
}

func cmdSupervise(args []string) error {
	fs := flag.NewFlagSet("supervise", flag.ContinueOnError)
	state := fs.String("state", "", "state directory (required)")
	owner := fs.Int("owner-pid", 0, "stop everything once this process is gone")
	ownerFD := fs.Int("owner-pidfd", 0, "inherited pidfd of --owner-pid, opened by up while the owner was alive")
	timeout := fs.Duration("timeout", defaultTimeout, "deadline for starting one cluster")
	removeState := fs.Bool("remove-state", false, "once stopped, remove the state directory unless it is to be kept (see keepState)")
	withNode := fs.Bool("node", false, "run a real node for the management cluster (node.go)")
	var clusters names
	fs.Var(&clusters, "cluster", "cluster to start (repeatable)")
	if _, err := parseArgs(fs, args, 0); err != nil {
		return err
	}
	dir, err := stateDir(*state)
	if err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	admin, err := adminClient(filepath.Join(dir, "pki"))
	if err != nil {
		return err
	}
	s := &supervisor{
		state: dir, self: self, timeout: *timeout, admin: admin,
		clusters: map[string]*cluster{}, usedPorts: map[int]bool{},
		withNode: *withNode,
	}
	var ownerHandle *liveness.Handle
	if *owner != 0 {
		if *ownerFD != 0 {
			ownerHandle = liveness.Adopt(*ownerFD, *owner)
		} else if ownerHandle, err = liveness.Open(*owner); err != nil {
			return fmt.Errorf("--owner-pid %d: %w", *owner, err)
		}
	}
	err = s.run(ownerHandle, *owner, clusters)
	if *removeState && err == nil {
		if why := keepState(dir); why != "" {
			log.Printf("state directory %s kept: %s", dir, why)
		} else if rmErr := removeStateDir(dir); rmErr != nil {
			log.Printf("remove state directory %s: %v", dir, rmErr)
		}
	}
	return err
}

const (
	// keepStateFile, created in the state directory by whoever used the
	// clusters (a test that failed), keeps the directory and its logs.
	keepStateFile = "keep"
	// keepStateEnv, set to anything but "" or "0", keeps every state directory.
	keepStateEnv = "VOLUME_GATE_KEEP_STATE"
)

// keepState says why the state directory must outlive the supervisor, or ""
// if it may go: a failed start, a user of the clusters that asked for it
// (DIR/keep), or VOLUME_GATE_KEEP_STATE.
func keepState(dir string) string {
	for _, f := range []string{keepStateFile, "failed"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err == nil {
			return filepath.Join(dir, f) + " exists"
		}
	}
	if v := os.Getenv(keepStateEnv); v != "" && v != "0" {
		return keepStateEnv + "=" + v
	}
	return ""
}

// removeStateDir removes the state directory once every process the
// supervisor started has exited. A process started by the directory's user
// (the simulator, killed with its owner) may still be writing in it for a
// moment, so a removal that finds a directory refilled is tried again.
func removeStateDir(dir string) error {
	var err error
	for attempt := 0; attempt < 10; attempt++ {
		if err = os.RemoveAll(dir); err == nil {
			return nil
		}
		time.Sleep(200 * time.Millisecond)
	}
	return err
}

func (s *supervisor) run(owner *liveness.Handle, ownerPID int, clusters []string) error {
	lock, err := lockFile(filepath.Join(s.state, "supervisor.lock"), false)
	if err != nil {
		return fmt.Errorf("another supervisor is running for %s: %w", s.state, err)
	}
	defer lock.Close()

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if owner != nil {
		ctx = watchOwner(ctx, owner, ownerPID)
	}
	s.ctx = ctx

	pidFile := filepath.Join(s.state, "supervisor.pid")
	if err := writeFileAtomic(pidFile, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
		return err
	}
	defer func() {
		for _, f := range []string{"ready", "control.addr", "supervisor.pid"} {
			os.Remove(filepath.Join(s.state, f))
		}
		log.Printf("supervisor stopped")
	}()
	defer s.shutdown()
	log.Printf("supervisor pid %d for %s, clusters %v", os.Getpid(), s.state, clusters)

	if err := s.startEtcd(); err != nil {
		return s.fail(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return s.fail(fmt.Errorf("control API: %w", err))
	}
	srv := &http.Server{Handler: s.routes()}
	go srv.Serve(ln)
	defer srv.Close()
	if err := writeFileAtomic(filepath.Join(s.state, "control.addr"), []byte("http://"+ln.Addr().String()+"\n"), 0o644); err != nil {
		return s.fail(err)
	}

	// Start the clusters in parallel: most of an apiserver's start is waiting.
	errs := make([]error, len(clusters))
	var wg sync.WaitGroup
	for i, name := range clusters {
		wg.Go(func() { _, errs[i] = s.startCluster(name, false, false) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return s.fail(err)
	}
	if s.withNode {
		info := s.clusters[managementCluster].info.Load()
		n, err := s.startNode(info, time.Now().Add(s.timeout))
		if err != nil {
			return s.fail(fmt.Errorf("node: %w", err))
		}
		s.mu.Lock()
		s.node = n
		s.mu.Unlock()
	}
	if err := os.WriteFile(filepath.Join(s.state, "ready"), nil, 0o644); err != nil {
		return s.fail(err)
	}
	log.Printf("ready: control API on http://%s", ln.Addr())

	<-ctx.Done()
	log.Printf("shutting down: %v", context.Cause(ctx))
	return nil
}

// fail records err in DIR/failed, where `harness up` reports it from.
func (s *supervisor) fail(err error) error {
	log.Printf("failed: %v", err)
	os.WriteFile(filepath.Join(s.state, "failed"), []byte(err.Error()+"\n"), 0o644)
	return err
}

// shutdown stops every cluster, then etcd.
func (s *supervisor) shutdown() {
	s.mu.Lock()
	s.closing = true
	n := s.node
	s.mu.Unlock()
	// The node first: its kubelet and containers talk to the management API.
	if n != nil {
		n.stop()
	}
	s.mu.Lock()
	clusters := make([]*cluster, 0, len(s.clusters))
	for _, c := range s.clusters {
		clusters = append(clusters, c)
	}
	s.mu.Unlock()
	var wg sync.WaitGroup
	for _, c := range clusters {
		wg.Go(func() {
			c.mu.Lock()
			defer c.mu.Unlock()
			s.stopProcs(c)
		})
	}
	wg.Wait()
	if s.etcd != nil {
		s.etcd.stop()
	}
}

func (s *supervisor) startEtcd() error {
	data := filepath.Join(s.state, "etcd")
	// A new supervisor means new, empty clusters: objects left by an earlier
	// run would leak into the next test. The PKI is kept.
	if err := os.RemoveAll(data); err != nil {
		return err
	}
	client, err := s.port(0)
	if err != nil {
		return err
	}
	peer, err := s.port(0)
	if err != nil {
		return err
	}
	s.etcdURL = fmt.Sprintf("http://127.0.0.1:%d", client)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", peer)
	p, err := s.spawn("etcd", filepath.Join(s.state, "logs", "etcd.log"), "etcd",
		"--name=harness",
		"--data-dir="+data,
		"--listen-client-urls="+s.etcdURL,
		"--advertise-client-urls="+s.etcdURL,
		"--listen-peer-urls="+peerURL,
		"--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster=harness="+peerURL,
		// Test data is thrown away, so durability buys nothing.
		"--unsafe-no-fsync=true",
	)
	if err != nil {
		return err
	}
	s.etcd = p
	plain := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{Proxy: nil}}
	return s.waitReady(p, plain, s.etcdURL+"/health", time.Now().Add(s.timeout))
}

// startCluster starts cluster name, or returns its info if it is running.
// light applies only when the cluster is first created.
func (s *supervisor) startCluster(name string, light, pod bool) (*clusterInfo, error) {
	if !validName(name) {
		return nil, errInvalidName(name)
	}
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		return nil, errors.New("supervisor is shutting down")
	}
	c := s.clusters[name]
	if c == nil {
		c = &cluster{name: name, light: light, pod: pod}
		s.clusters[name] = c
	}
	s.mu.Unlock()

	c.mu.Lock()
	defer c.mu.Unlock()
	if info := c.info.Load(); info != nil && allRunning(info.procs) {
		return info, nil
	}
	s.stopProcs(c) // whatever is left of a cluster one of whose components died
	for attempt := 1; ; attempt++ {
		info, err := s.bootCluster(c)
		if err == nil {
			c.info.Store(info)
			return info, nil
		}
		s.stopProcs(c)
		// A port is picked free and bound by its component a moment later:
		// another process of this machine (another test binary) can take it
		// in between. Then the cluster starts again, on ports picked anew.
		if attempt == 3 || !strings.Contains(err.Error(), "address already in use") {
			return nil, err
		}
		log.Printf("cluster %s: a port was taken before its component bound it; starting it again on other ports (attempt %d of 3): %v", name, attempt+1, err)
		for i := range c.ports {
			c.ports[i] = 0
		}
	}
}

func (s *supervisor) stopCluster(name string) {
	s.mu.Lock()
	c := s.clusters[name]
	s.mu.Unlock()
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	s.stopProcs(c)
}

// stopProcs stops c's components, the apiserver last. The caller holds c.mu.
func (s *supervisor) stopProcs(c *cluster) {
	c.info.Store(nil)
	os.Remove(filepath.Join(s.state, c.name, "info.json"))
	for _, p := range slices.Backward(c.procs) {
		p.stop()
	}
	c.procs = nil
}

// component is one process of a cluster: its command line (the
// component's name first) and the URL its health is read at.
type component struct {
	args   []string
	health string
}

// components returns the command lines of cluster c's components, the
// apiserver first: the controller manager, and the scheduler unless the
// cluster is light (or is the management cluster without a real node).
func (s *supervisor) components(c *cluster, info *clusterInfo, dir string) []component {
	pki := func(file string) string { return filepath.Join(s.state, "pki", file) }
	serving := []string{"--tls-cert-file=" + pki(servingCertFile), "--tls-private-key-file=" + pki(servingKeyFile)}

	apiserverArgs := append([]string{"kube-apiserver",
		"--etcd-servers=" + s.etcdURL,
		"--etcd-prefix=" + info.EtcdPrefix,
		"--storage-backend=etcd3",
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		// The endpoint reconciler refuses a loopback advertise address; the
		// default/kubernetes Service gets no endpoints, which nothing here uses.
		"--endpoint-reconciler-type=none",
		"--secure-port=" + strconv.Itoa(c.ports[0]),
		"--cert-dir=" + filepath.Join(dir, "certs"),
		"--client-ca-file=" + pki(caCertFile),
		"--service-account-issuer=" + serviceAccountIssuer,
		"--api-audiences=" + serviceAccountIssuer,
		"--service-account-key-file=" + pki(saPubFile),
		"--service-account-signing-key-file=" + pki(saKeyFile),
		"--service-cluster-ip-range=10.96.0.0/16",
		"--authorization-mode=RBAC",
		"--allow-privileged=true",
		"--profiling=false",
		"--enable-priority-and-fairness=false",
	}, serving...)
	if c.light {
		apiserverArgs = append(apiserverArgs, "--runtime-config="+lightAPIs)
	}
	realNode := c.name == managementCluster && s.withNode
	if realNode {
		// Webhooks and APIServices by a ready endpoint's IP (no kube-proxy);
		// logs and exec through the kubelet with the admin certificate.
		apiserverArgs = append(apiserverArgs,
			"--enable-aggregator-routing=true",
			"--kubelet-client-certificate="+pki(adminCertFile),
			"--kubelet-client-key="+pki(adminKeyFile),
			"--kubelet-preferred-address-types=InternalIP",
		)
	}
	out := []component{{args: apiserverArgs, health: info.Server + "/readyz"}}

	kubeconfig := []string{
		"--kubeconfig=" + info.Kubeconfig,
		"--authentication-kubeconfig=" + info.Kubeconfig,
		"--authorization-kubeconfig=" + info.Kubeconfig,
		"--bind-address=127.0.0.1",
		"--leader-elect=false",
	}
	// The controller manager runs every default controller (garbage
	// collector, namespace, PV binder, PVC/PV protection, StatefulSet, ...).
	var controllers []string
	if c.light {
		controllers = []string{"--controllers=" + lightControllers}
	}
	// The default client rate (20 requests/s) makes the PV controller, not
	// what is tested, the floor of every release: binding or releasing
	// 5,000 volumes took over 10 minutes. Production controller managers
	// are commonly tuned up the same way.
	kcmArgs := slices.Concat([]string{"kube-controller-manager",
		"--kube-api-qps=200",
		"--kube-api-burst=400",
		"--secure-port=" + strconv.Itoa(c.ports[1]),
		"--service-account-private-key-file=" + pki(saKeyFile),
		"--root-ca-file=" + pki(caCertFile),
		// Each controller acts as its own ServiceAccount, as kubeadm's
		// controller manager does (its static Pod sets this flag): the
		// namespace controller's requests carry
		// system:serviceaccount:kube-system:namespace-controller, the name
		// the gate's namespace rules know it by. With the controller
		// manager's own credentials every controller was "admin", and those
		// rules never saw it.
		"--use-service-account-credentials=true",
		"--cluster-signing-cert-file=" + pki(caCertFile),
		"--cluster-signing-key-file=" + pki(caKeyFile),
	}, kubeconfig, serving, controllers)
	out = append(out, component{args: kcmArgs, health: fmt.Sprintf("https://127.0.0.1:%d/healthz", c.ports[1])})
	if (c.name != managementCluster || realNode) && !c.light {
		schedArgs := slices.Concat([]string{"kube-scheduler",
			"--secure-port=" + strconv.Itoa(c.ports[2]),
		}, kubeconfig, serving)
		out = append(out, component{args: schedArgs, health: fmt.Sprintf("https://127.0.0.1:%d/healthz", c.ports[2])})
	}
	return out
}

func (s *supervisor) bootCluster(c *cluster) (*clusterInfo, error) {
	dir := filepath.Join(s.state, c.name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	deadline := time.Now().Add(s.timeout)
	for i := range c.ports {
		port, err := s.port(c.ports[i])
		if err != nil {
			return nil, err
		}
		c.ports[i] = port
	}
	pki := func(file string) string { return filepath.Join(s.state, "pki", file) }
	logFile := func(component string) string {
		return filepath.Join(s.state, "logs", c.name+"-"+component+".log")
	}
	info := &clusterInfo{
		Name:           c.name,
		Server:         fmt.Sprintf("https://127.0.0.1:%d", c.ports[0]),
		Kubeconfig:     filepath.Join(dir, "kubeconfig"),
		EtcdPrefix:     "/registry-" + c.name,
		CAFile:         pki(caCertFile),
		ClientCertFile: pki(adminCertFile),
		ClientKeyFile:  pki(adminKeyFile),
		Logs:           map[string]string{},
	}
	comps := s.components(c, info, dir)
	if c.pod {
		// Prepared, not run: the caller's Pods run the components.
		if err := writeKubeconfig(info.Kubeconfig, c.name, info.Server, filepath.Join(s.state, "pki")); err != nil {
			return nil, err
		}
		info.Commands = map[string][]string{}
		for _, comp := range comps {
			info.Commands[comp.args[0]] = comp.args
		}
		info.Light = c.light
		info.Running = true
		return info, s.writeInfo(dir, c.name, info)
	}
	api, err := s.spawnFor(c, info, comps[0].args[0], logFile, comps[0].args)
	if err != nil {
		return nil, err
	}
	if err := s.waitReady(api, s.admin, comps[0].health, deadline); err != nil {
		return nil, err
	}
	if err := writeKubeconfig(info.Kubeconfig, c.name, info.Server, filepath.Join(s.state, "pki")); err != nil {
		return nil, err
	}
	waits := map[*proc]string{}
	for _, comp := range comps[1:] {
		p, err := s.spawnFor(c, info, comp.args[0], logFile, comp.args)
		if err != nil {
			return nil, err
		}
		waits[p] = comp.health
	}
	for p, url := range waits {
		if err := s.waitReady(p, s.admin, url, deadline); err != nil {
			return nil, err
		}
	}

	info.procs = slices.Clone(c.procs)
	info.APIServerPID = c.procs[0].pid()
	info.KCMPID = c.procs[1].pid()
	if len(c.procs) > 2 {
		info.SchedulerPID = c.procs[2].pid()
	}
	info.Light = c.light
	info.Running = true
	return info, s.writeInfo(dir, c.name, info)
}

// writeInfo writes a started cluster's info.json.
func (s *supervisor) writeInfo(dir, name string, info *clusterInfo) error {
	data, err := json.MarshalIndent(info, "", "  ")
	if err != nil {
		return err
	}
	if err := writeFileAtomic(filepath.Join(dir, "info.json"), append(data, '\n'), 0o644); err != nil {
		return err
	}
	log.Printf("cluster %s ready at %s", name, info.Server)
	return nil
}

// spawnFor starts one component of cluster c; args[0] is the component.
func (s *supervisor) spawnFor(c *cluster, info *clusterInfo, component string, logFile func(string) string, args []string) (*proc, error) {
	path := logFile(component)
	p, err := s.spawn(c.name+" "+component, path, args...)
	if err != nil {
		return nil, err
	}
	c.procs = append(c.procs, p)
	info.Logs[component] = path
	return p, nil
}

func (s *supervisor) spawn(name, logPath string, args ...string) (*proc, error) {
	return s.spawnBinary(name, logPath, s.self, args...)
}

// spawnBinary starts bin (a path, or a name on PATH) as a supervised process.
func (s *supervisor) spawnBinary(name, logPath, bin string, args ...string) (*proc, error) {
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	shown := "harness"
	if bin != s.self {
		shown = bin
	}
	fmt.Fprintf(f, "=== %s %s %s\n", time.Now().Format(time.RFC3339), shown, strings.Join(args, " "))
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	// If the supervisor is SIGKILLed, the kernel kills its components too, so
	// no orphan keeps a port or etcd busy.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, logPath: logPath, cmd: cmd, done: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		if !p.stopping.Load() {
			log.Printf("%s (pid %d) exited unexpectedly: %v; see %s", name, p.pid(), err, logPath)
		}
		close(p.done)
	}()
	log.Printf("started %s (pid %d), log %s", name, p.pid(), logPath)
	return p, nil
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

func allRunning(procs []*proc) bool {
	for _, p := range procs {
		if !p.running() {
			return false
		}
	}
	return true
}

// stop sends SIGTERM, then SIGKILL after stopGrace, and returns once the
// process has been reaped.
func (p *proc) stop() {
	p.stopping.Store(true)
	if !p.running() {
		return
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(stopGrace):
		log.Printf("%s (pid %d) still running %s after SIGTERM; sending SIGKILL", p.name, p.pid(), stopGrace)
		p.cmd.Process.Kill()
		<-p.done
	}
	log.Printf("stopped %s (pid %d)", p.name, p.pid())
}

// failure names the component and shows the end of its log.
func (p *proc) failure(err error) error {
	return fmt.Errorf("%s (pid %d): %w\n--- last lines of %s ---\n%s", p.name, p.pid(), err, p.logPath, tail(p.logPath, 25))
}

// waitReady polls url until it answers 200, p exits, the deadline passes or
// the supervisor is stopping.
func (s *supervisor) waitReady(p *proc, client *http.Client, url string, deadline time.Time) error {
	last := "no answer yet"
	for {
		select {
		case <-p.done:
			return p.failure(fmt.Errorf("exited before becoming ready (%v)", p.cmd.ProcessState))
		case <-s.ctx.Done():
			return fmt.Errorf("%s: interrupted while waiting for %s: %v", p.name, url, context.Cause(s.ctx))
		default:
		}
		resp, err := client.Get(url)
		if err == nil {
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 16<<10))
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = resp.Status + " " + failedChecks(body)
		} else {
			last = err.Error()
		}
		if time.Now().After(deadline) {
			return p.failure(fmt.Errorf("%s not ready before the deadline: %s", url, last))
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// failedChecks keeps the "[-]check failed" lines of a verbose /readyz answer.
func failedChecks(body []byte) string {
	var failed []string
	for line := range strings.Lines(string(body)) {
		if strings.HasPrefix(line, "[-]") {
			failed = append(failed, strings.TrimSpace(line))
		}
	}
	if len(failed) == 0 {
		return strings.TrimSpace(string(body))
	}
	return strings.Join(failed, "; ")
}

// port returns prev if it is still free, else a free loopback port not yet
// handed out by this supervisor.
func (s *supervisor) port(prev int) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if prev != 0 {
		if l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(prev))); err == nil {
			l.Close()
			return prev, nil
		}
	}
	// Below the ephemeral range: a port picked from it can be taken as the
	// local end of some outgoing connection before the component binds it.
	lo, hi := listenPortRange()
	for range 200 {
		port := lo + rand.IntN(hi-lo)
		if s.usedPorts[port] {
			continue
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			continue
		}
		l.Close()
		s.usedPorts[port] = true
		return port, nil
	}
	return 0, fmt.Errorf("no free loopback port in %d-%d", lo, hi)
}

// listenPortRange is where listening ports are picked: from 10000 up to the
// start of the kernel's ephemeral range (or 32768).
func listenPortRange() (int, int) {
	hi := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if v, err := strconv.Atoi(f[0]); err == nil && v > 11000 {
				hi = v
			}
		}
	}
	return 10000, hi
}

func (s *supervisor) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /clusters", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, s.list())
	})
	mux.HandleFunc("GET /clusters/{name}", func(w http.ResponseWriter, r *http.Request) {
		for _, info := range s.list() {
			if info.Name == r.PathValue("name") {
				writeJSON(w, http.StatusOK, info)
				return
			}
		}
		http.Error(w, "no such cluster running", http.StatusNotFound)
	})
	mux.HandleFunc("POST /clusters/{name}", func(w http.ResponseWriter, r *http.Request) {
		name := r.PathValue("name")
		if !validName(name) {
			http.Error(w, errInvalidName(name).Error(), http.StatusBadRequest)
			return
		}
		// ?profile=light: a tenant cluster with only what the volume-release
		// phase and the simulator use (see lightAPIs).
		profile := r.URL.Query().Get("profile")
		if profile != "" && profile != "light" {
			http.Error(w, fmt.Sprintf("unknown profile %q: want light or none", profile), http.StatusBadRequest)
			return
		}
		// ?run=pod: prepared only, its components' command lines returned
		// for the caller's Pods to run (clusterInfo.Commands).
		run := r.URL.Query().Get("run")
		if run != "" && run != "pod" {
			http.Error(w, fmt.Sprintf("unknown run %q: want pod or none", run), http.StatusBadRequest)
			return
		}
		info, err := s.startCluster(name, profile == "light", run == "pod")
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		writeJSON(w, http.StatusOK, info)
	})
	mux.HandleFunc("DELETE /clusters/{name}", func(w http.ResponseWriter, r *http.Request) {
		s.stopCluster(r.PathValue("name"))
		w.WriteHeader(http.StatusNoContent)
	})
	return mux
}

// list returns the started clusters, sorted by name; Running is false for a
// cluster one of whose components has died.
func (s *supervisor) list() []clusterInfo {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := []clusterInfo{}
	for _, c := range s.clusters {
		if info := c.info.Load(); info != nil {
			copied := *info
			copied.Running = allRunning(info.procs)
			out = append(out, copied)
		}
	}
	slices.SortFunc(out, func(a, b clusterInfo) int { return strings.Compare(a.Name, b.Name) })
	return out
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(v)
}

// watchOwner returns a context cancelled once the owner process has
// terminated, as its pidfd says.
func watchOwner(parent context.Context, owner *liveness.Handle, pid int) context.Context {
	ctx, cancel := context.WithCancelCause(parent)
	go func() {
		defer owner.Close()
		if owner.Wait(ctx) == nil {
			log.Printf("owner pid %d is gone", pid)
			cancel(fmt.Errorf("owner pid %d is gone", pid))
		}
	}()
	return ctx
}

func adminClient(pkiDir string) (*http.Client, error) {
	caPEM, err := os.ReadFile(filepath.Join(pkiDir, caCertFile))
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return nil, fmt.Errorf("no certificate in %s", filepath.Join(pkiDir, caCertFile))
	}
	cert, err := tls.LoadX509KeyPair(filepath.Join(pkiDir, adminCertFile), filepath.Join(pkiDir, adminKeyFile))
	if err != nil {
		return nil, err
	}
	return &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{
			Proxy:           nil,
			TLSClientConfig: &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}},
		},
	}, nil
}

// writeKubeconfig writes an admin kubeconfig with everything embedded.
func writeKubeconfig(path, name, server, pkiDir string) error {
	read := func(file string) ([]byte, error) { return os.ReadFile(filepath.Join(pkiDir, file)) }
	ca, err := read(caCertFile)
	if err != nil {
		return err
	}
	crt, err := read(adminCertFile)
	if err != nil {
		return err
	}
	key, err := read(adminKeyFile)
	if err != nil {
		return err
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters[name] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: ca}
	cfg.AuthInfos["admin"] = &clientcmdapi.AuthInfo{ClientCertificateData: crt, ClientKeyData: key}
	cfg.Contexts[name] = &clientcmdapi.Context{Cluster: name, AuthInfo: "admin"}
	cfg.CurrentContext = name
	data, err := clientcmd.Write(*cfg)
	if err != nil {
		return err
	}
	return writeFileAtomic(path, data, 0o600)
}
