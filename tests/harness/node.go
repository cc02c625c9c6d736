package main

// node.go: one real node for the management cluster (`up --node`): the
// kubelet of the Kubernetes release this binary is built from (`harness
// kubelet`), containerd with runc as its container runtime, and a CNI
// bridge. Tenant clusters keep their simulated kubelets.
//
// The node is the machine's: one at a time (a lock in /run), on a fixed
// bridge and subnet, in a cgroup of its own. What it changes on the host is
// undone when it stops, and found and undone when a crashed run left it:
//
//   - bridge vgnode0 with 10.244.0.1/24 (the node's IP; Pods get
//     10.244.0.10 and up), route_localnet on it, and DNAT rules: a Pod's
//     10.96.0.1:443 (the kubernetes Service) reaches the management API server
//     on 127.0.0.1, and 10.244.0.1:PORT, for the harness's listening ports,
//     reaches 127.0.0.1:PORT (the tenant API servers, by the node's IP, from
//     Pods and from this machine alike). Nothing is forwarded (ip_forward
//     stays as it is) and Pods have no default route: their packets reach this
//     machine and nothing beyond it. The kubelet listens on the node's IP.
//   - cgroup /volume-gate-node in every v1 hierarchy (the kubelet's
//     cgroupRoot), which holds every container.
//   - the sysctls the kubelet sets (vm.overcommit_memory, kernel.panic, ...),
//     restored to what they were.
//
// The API server reaches admission webhooks and the kubelet by Pod and node
// IP (--enable-aggregator-routing resolves a Service to a ready endpoint): no
// kube-proxy, no DNS.

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

const (
	nodeName      = "vg-node"
	nodeBridge    = "vgnode0"
	nodeIP        = "10.244.0.1"
	nodeSubnet    = "10.244.0.0/24"
	nodeCgroup    = "volume-gate-node"
	nodeLock      = "/run/volume-gate-node.lock"
	nodeRuleTag   = "volume-gate-node"
	sandboxImage  = "registry.k8s.io/pause:3.10"
	hookImage     = "docker.io/clastix/kubectl:v1.32"
	cniBinDir     = "/usr/lib/cni"
	kubernetesSvc = "10.96.0.1"
)

// kubeletSysctls are the host settings the kubelet's container manager sets
// (setupKernelTunables); they are restored when the node stops.
var kubeletSysctls = []string{
	"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
	"kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes",
}

// cgroupV1Needed are the v1 controllers the kubelet's cgroupfs manager needs.
var cgroupV1Needed = []string{"cpu", "cpuacct", "cpuset", "memory", "pids", "devices", "freezer"}

// node is the running node's state, owned by the supervisor.
type node struct {
	dir        string
	lock       *os.File
	containerd *proc
	kubelet    *proc
	sysctls    map[string]string
	rules      [][]string
}

// nodePreflight names everything a real node needs that this machine lacks.
func nodePreflight() error {
	var missing []string
	if os.Geteuid() != 0 {
		missing = append(missing, "root (containerd, runc and the kubelet need it)")
	}
	for bin, pkg := range map[string]string{
		"containerd": "containerd", "ctr": "containerd", "runc": "runc",
		"iptables": "iptables", "iptables-save": "iptables", "ip": "iproute2", "busybox": "busybox-static",
	} {
		if _, err := exec.LookPath(bin); err != nil {
			missing = append(missing, fmt.Sprintf("%s (Debian package %s)", bin, pkg))
		}
	}
	for _, plugin := range []string{"bridge", "host-local", "loopback"} {
		if _, err := os.Stat(filepath.Join(cniBinDir, plugin)); err != nil {
			missing = append(missing, fmt.Sprintf("the CNI plugin %s/%s (Debian package containernetworking-plugins)", cniBinDir, plugin))
		}
	}
	if fs, err := os.ReadFile("/proc/filesystems"); err != nil || !bytes.Contains(fs, []byte("\toverlay\n")) {
		missing = append(missing, "the overlay filesystem (containerd's snapshotter)")
	}
	for _, c := range cgroupV1Needed {
		if _, err := os.Stat(filepath.Join("/sys/fs/cgroup", c, "cgroup.procs")); err != nil {
			missing = append(missing, fmt.Sprintf("the cgroup v1 controller %s mounted at /sys/fs/cgroup/%s", c, c))
		}
	}
	sort := slices.Sorted(slices.Values(missing))
	if len(sort) > 0 {
		return fmt.Errorf("a real node cannot run here; missing: %s (Debian: apt-get install containerd runc containernetworking-plugins busybox-static iptables iproute2)", strings.Join(sort, "; "))
	}
	return nil
}

// startNode brings the node up for the management cluster info (ready):
// host network and cgroup, containerd, the images every Pod needs (the
// sandbox and the hook's kubectl), the kubelet; returns once the Node is
// Ready.
func (s *supervisor) startNode(info *clusterInfo, deadline time.Time) (*node, error) {
	if err := nodePreflight(); err != nil {
		return nil, err
	}
	lock, err := lockFile(nodeLock, false)
	if err != nil {
		log.Printf("waiting for %s: another run's node is up", nodeLock)
		if lock, err = lockFile(nodeLock, true); err != nil {
			return nil, err
		}
	}
	n := &node{dir: filepath.Join(s.state, "node"), lock: lock, sysctls: map[string]string{}}
	// What a crashed run left is ours to undo: the lock says no other node runs.
	n.cleanHost()
	fail := func(err error) (*node, error) {
		n.stop()
		return nil, err
	}
	for _, d := range []string{"containerd/root", "containerd/state", "containerd/opt", "cni", "cni-ipam", "kubelet", "pod-logs", "images"} {
		if err := os.MkdirAll(filepath.Join(n.dir, d), 0o755); err != nil {
			return fail(err)
		}
	}
	apiPort := strings.TrimPrefix(info.Server, "https://127.0.0.1:")
	if err := n.network(apiPort); err != nil {
		return fail(fmt.Errorf("node network: %w", err))
	}
	if err := n.cgroups(); err != nil {
		return fail(fmt.Errorf("node cgroup: %w", err))
	}
	if err := n.writeContainerdConfig(); err != nil {
		return fail(err)
	}
	logFile := filepath.Join(s.state, "logs", "node-containerd.log")
	if n.containerd, err = s.spawnBinary("node containerd", logFile, "containerd", "--config", filepath.Join(n.dir, "containerd.toml")); err != nil {
		return fail(err)
	}
	if err := n.waitContainerd(deadline); err != nil {
		return fail(n.containerd.failure(err))
	}
	kubectl, err := kubectlBeside(s.self)
	if err != nil {
		return fail(err)
	}
	for _, spec := range n.builtinImages(kubectl) {
		if err := n.importImage(spec); err != nil {
			return fail(err)
		}
	}
	for _, key := range kubeletSysctls {
		if v, err := os.ReadFile(filepath.Join("/proc/sys", key)); err == nil {
			n.sysctls[key] = strings.TrimSpace(string(v))
		}
	}
	config, err := n.writeKubeletConfig(filepath.Join(s.state, "pki"))
	if err != nil {
		return fail(err)
	}
	kubeletLog := filepath.Join(s.state, "logs", "node-kubelet.log")
	n.kubelet, err = s.spawnBinary("node kubelet", kubeletLog, s.self, "kubelet",
		"--config="+config,
		"--kubeconfig="+info.Kubeconfig,
		"--root-dir="+filepath.Join(n.dir, "kubelet"),
		"--hostname-override="+nodeName,
		"--node-ip="+nodeIP,
		"--v=2",
	)
	if err != nil {
		return fail(err)
	}
	if err := n.waitReady(s, info, deadline); err != nil {
		return fail(n.kubelet.failure(err))
	}
	log.Printf("node %s ready (containerd %s, kubelet %s)", nodeName, logFile, kubeletLog)
	return n, nil
}

// stop undoes startNode, whatever it got to: the kubelet, every container
// (the processes in the node's cgroup), containerd and its shims, the mounts
// under the node's directory, the host network, the cgroup, the sysctls.
func (n *node) stop() {
	if n.kubelet != nil {
		n.kubelet.stop()
	}
	killCgroup()
	if n.containerd != nil {
		n.containerd.stop()
	}
	n.killShims()
	unmountUnder(n.dir)
	n.cleanHost()
	for key, v := range n.sysctls {
		if cur, err := os.ReadFile(filepath.Join("/proc/sys", key)); err == nil && strings.TrimSpace(string(cur)) != v {
			if err := os.WriteFile(filepath.Join("/proc/sys", key), []byte(v), 0o644); err != nil {
				log.Printf("node: restore %s=%s: %v", key, v, err)
			} else {
				log.Printf("node: restored %s=%s (the kubelet had set %s)", key, v, strings.TrimSpace(string(cur)))
			}
		}
	}
	if n.lock != nil {
		n.lock.Close()
	}
}

// cleanHost removes the bridge, the DNAT rules (by their comment) and the
// cgroup; each is the node's alone.
func (n *node) cleanHost() {
	killCgroup()
	if _, err := os.Stat("/sys/class/net/" + nodeBridge); err == nil {
		run("ip", "link", "del", nodeBridge)
	}
	if out, err := exec.Command("iptables-save", "-t", "nat").Output(); err == nil {
		sc := bufio.NewScanner(bytes.NewReader(out))
		for sc.Scan() {
			line := sc.Text()
			if strings.HasPrefix(line, "-A ") && strings.Contains(line, nodeRuleTag) {
				args := append([]string{"-t", "nat", "-D"}, strings.Fields(strings.TrimPrefix(line, "-A "))...)
				// iptables-save quotes the comment; the tag has no spaces.
				for i, a := range args {
					args[i] = strings.Trim(a, `"`)
				}
				run("iptables", args...)
			}
		}
	}
	for _, c := range cgroupControllers() {
		removeCgroupTree(filepath.Join("/sys/fs/cgroup", c, nodeCgroup))
	}
}

// network makes the bridge and the two DNAT rules.
func (n *node) network(apiPort string) error {
	steps := [][]string{
		{"ip", "link", "add", nodeBridge, "type", "bridge"},
		{"ip", "addr", "add", nodeIP + "/24", "dev", nodeBridge},
		{"ip", "link", "set", nodeBridge, "up"},
	}
	for _, s := range steps {
		if err := run(s[0], s[1:]...); err != nil {
			return err
		}
	}
	if err := os.WriteFile("/proc/sys/net/ipv4/conf/"+nodeBridge+"/route_localnet", []byte("1"), 0o644); err != nil {
		return err
	}
	comment := []string{"-m", "comment", "--comment", nodeRuleTag}
	// The harness's API servers listen on loopback ports of this range; the
	// node's IP forwards exactly those to loopback, from Pods (PREROUTING)
	// and from this machine's own processes (OUTPUT: the simulator reads the
	// same kubeconfig Secrets as the Pods). The kubelet's own ports are below it.
	lo, hi := listenPortRange()
	ports := fmt.Sprintf("%d:%d", lo, hi-1)
	rules := [][]string{
		slices.Concat([]string{"PREROUTING", "-i", nodeBridge, "-d", kubernetesSvc + "/32", "-p", "tcp", "--dport", "443"}, comment,
			[]string{"-j", "DNAT", "--to-destination", "127.0.0.1:" + apiPort}),
		slices.Concat([]string{"PREROUTING", "-i", nodeBridge, "-d", nodeIP + "/32", "-p", "tcp", "--dport", ports}, comment,
			[]string{"-j", "DNAT", "--to-destination", "127.0.0.1"}),
		slices.Concat([]string{"OUTPUT", "-d", nodeIP + "/32", "-p", "tcp", "--dport", ports}, comment,
			[]string{"-j", "DNAT", "--to-destination", "127.0.0.1"}),
	}
	for _, r := range rules {
		if err := run("iptables", append([]string{"-t", "nat", "-A"}, r...)...); err != nil {
			return err
		}
	}
	conf := map[string]any{
		"cniVersion": "1.0.0",
		"name":       "volume-gate-node",
		"plugins": []any{map[string]any{
			"type": "bridge", "bridge": nodeBridge, "isGateway": false, "ipMasq": false,
			"ipam": map[string]any{
				"type":    "host-local",
				"dataDir": filepath.Join(n.dir, "cni-ipam"),
				"ranges":  []any{[]any{map[string]any{"subnet": nodeSubnet, "rangeStart": "10.244.0.10", "gateway": nodeIP}}},
				// The kubernetes Service only: no default route.
				"routes": []any{map[string]any{"dst": "10.96.0.0/16", "gw": nodeIP}},
			},
		}},
	}
	data, err := json.MarshalIndent(conf, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(n.dir, "cni", "10-volume-gate-node.conflist"), data, 0o644)
}

// cgroups makes the node's cgroup in every v1 hierarchy (the kubelet
// requires its cgroupRoot to exist); a cpuset child starts with no CPUs or
// memory nodes, so those are copied from the root.
func (n *node) cgroups() error {
	for _, c := range cgroupControllers() {
		dir := filepath.Join("/sys/fs/cgroup", c, nodeCgroup)
		if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return err
		}
		if c == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				v, err := os.ReadFile(filepath.Join("/sys/fs/cgroup", c, f))
				if err != nil {
					return err
				}
				if err := os.WriteFile(filepath.Join(dir, f), v, 0o644); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// cgroupControllers are the v1 hierarchies mounted under /sys/fs/cgroup.
func cgroupControllers() []string {
	entries, _ := os.ReadDir("/sys/fs/cgroup")
	var out []string
	for _, e := range entries {
		if e.Name() == "unified" || !e.IsDir() {
			continue
		}
		if _, err := os.Stat(filepath.Join("/sys/fs/cgroup", e.Name(), "cgroup.procs")); err == nil {
			out = append(out, e.Name())
		}
	}
	return out
}

// killCgroup SIGKILLs every process in the node's cgroup (the containers,
// and only them: nothing else is put there) until none is left.
func killCgroup() {
	root := filepath.Join("/sys/fs/cgroup", "pids", nodeCgroup)
	for attempt := 0; attempt < 50; attempt++ {
		pids := cgroupPids(root)
		if len(pids) == 0 {
			return
		}
		for _, pid := range pids {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(100 * time.Millisecond)
	}
	log.Printf("node: processes left in %s: %v", root, cgroupPids(root))
}

func cgroupPids(root string) []int {
	var pids []int
	filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
			return nil
		}
		data, _ := os.ReadFile(p)
		for _, f := range strings.Fields(string(data)) {
			if pid, err := strconv.Atoi(f); err == nil {
				pids = append(pids, pid)
			}
		}
		return nil
	})
	return pids
}

// removeCgroupTree removes a cgroup and its children, deepest first.
func removeCgroupTree(root string) {
	var dirs []string
	filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := syscall.Rmdir(dirs[i]); err != nil && !errors.Is(err, os.ErrNotExist) {
			log.Printf("node: rmdir %s: %v", dirs[i], err)
		}
	}
}

// killShims kills the containerd shims of this node's containerd (each
// names its socket on its command line), which outlive containerd.
func (n *node) killShims() {
	sock := filepath.Join(n.dir, "containerd.sock")
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(cmdline), "\x00")
		if strings.Contains(args[0], "containerd-shim") && slices.Contains(args, sock) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// unmountUnder detaches every mount below dir (the kubelet's volumes,
// containerd's rootfs and shm mounts, network namespaces), deepest first.
func unmountUnder(dir string) {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return
	}
	var points []string
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && (f[4] == dir || strings.HasPrefix(f[4], dir+"/")) {
			points = append(points, f[4])
		}
	}
	slices.SortFunc(points, func(a, b string) int { return len(b) - len(a) })
	for _, p := range points {
		if err := syscall.Unmount(p, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) {
			log.Printf("node: unmount %s: %v", p, err)
		}
	}
}

// capSysResource is CAP_SYS_RESOURCE's bit in /proc/self/status's CapEff.
const capSysResource = 24

// canLowerOOMScore says whether this process may lower an oom_score_adj
// below its own (CAP_SYS_RESOURCE). Some sandboxes drop it even for root:
// the kubelet asks -998 for every Pod sandbox and runc, unable to write it,
// fails the container ("nsexec: failed to update /proc/self/oom_score_adj:
// Permission denied"). Without it containerd's restrict_oom_score_adj clamps
// every score to containerd's own, the knob containerd has for exactly
// this; the scores are not what anything here tests.
func canLowerOOMScore() bool {
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(status), "\n") {
		if hex, ok := strings.CutPrefix(line, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(hex), 16, 64)
			return err == nil && caps&(1<<capSysResource) != 0
		}
	}
	return false
}

func (n *node) writeContainerdConfig() error {
	d := func(p string) string { return filepath.Join(n.dir, p) }
	config := fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs"]

[grpc]
  address = %q

[plugins."io.containerd.internal.v1.opt"]
  path = %q

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  disable_apparmor = true
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = %t
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
`, d("containerd/root"), d("containerd/state"), d("containerd.sock"), d("containerd/opt"), sandboxImage, !canLowerOOMScore(), cniBinDir, d("cni"))
	return os.WriteFile(d("containerd.toml"), []byte(config), 0o644)
}

func (n *node) ctr(args ...string) *exec.Cmd {
	return exec.Command("ctr", append([]string{"--address", filepath.Join(n.dir, "containerd.sock"), "--namespace", "k8s.io"}, args...)...)
}

func (n *node) waitContainerd(deadline time.Time) error {
	last := ""
	for time.Now().Before(deadline) {
		out, err := n.ctr("version").CombinedOutput()
		if err == nil {
			return nil
		}
		last = strings.TrimSpace(string(out))
		if !n.containerd.running() {
			return fmt.Errorf("containerd exited: %s", last)
		}
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("containerd not answering: %s", last)
}

// builtinImages are the images every run needs: the Pod sandbox (busybox's
// sleep: containerd stops a sandbox with SIGKILL) and Cozystack's hook
// image, a shell and kubectl.
func (n *node) builtinImages(kubectl string) []imageSpec {
	busybox, _ := exec.LookPath("busybox")
	links := func(extra map[string]string) map[string]string {
		m := map[string]string{}
		for _, tool := range []string{"sh", "sleep", "grep", "echo", "cat", "ls", "env", "test", "["} {
			m["/bin/"+tool] = "busybox"
		}
		for k, v := range extra {
			m[k] = v
		}
		return m
	}
	return []imageSpec{
		{
			Name: sandboxImage, Entrypoint: []string{"/bin/sleep", "2147483647"}, User: "65535:65535",
			Files: map[string]string{"/bin/busybox": busybox}, Links: links(nil),
		},
		{
			Name: hookImage, Entrypoint: []string{"/bin/sh"},
			Env:   []string{"PATH=/usr/local/bin:/bin"},
			Files: map[string]string{"/bin/busybox": busybox, "/usr/local/bin/kubectl": kubectl},
			Links: links(nil),
		},
	}
}

// importImage writes spec's archive and imports it into containerd.
func (n *node) importImage(spec imageSpec) error {
	file := filepath.Join(n.dir, "images", strings.NewReplacer("/", "_", ":", "_").Replace(spec.Name)+".tar")
	if err := writeImage(file, spec); err != nil {
		return err
	}
	return n.importArchive(file)
}

func (n *node) importArchive(file string) error {
	out, err := n.ctr("images", "import", "--platform", "linux/amd64", file).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ctr images import %s: %v: %s", file, err, out)
	}
	return nil
}

func (n *node) writeKubeletConfig(pkiDir string) (string, error) {
	// Below listenPortRange, which the node's IP forwards to loopback.
	port, healthz := 9250, 9248
	config := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: %s
port: %d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %d
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: %q}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
cgroupRoot: /%s
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://%s
resolvConf: ""
podLogsDir: %q
evictionHard: {"memory.available": "100Mi", "nodefs.available": "1%%", "imagefs.available": "1%%", "nodefs.inodesFree": "1%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
`, nodeIP, port, healthz, filepath.Join(pkiDir, caCertFile), nodeCgroup,
		filepath.Join(n.dir, "containerd.sock"), filepath.Join(n.dir, "pod-logs"))
	path := filepath.Join(n.dir, "kubelet.yaml")
	return path, os.WriteFile(path, []byte(config), 0o644)
}

// waitReady waits for Node nodeName to be Ready, as the API server says.
func (n *node) waitReady(s *supervisor, info *clusterInfo, deadline time.Time) error {
	last := "not registered yet"
	for time.Now().Before(deadline) {
		if !n.kubelet.running() {
			return errors.New("the kubelet exited")
		}
		resp, err := s.admin.Get(info.Server + "/api/v1/nodes/" + nodeName)
		if err == nil {
			var node struct {
				Status struct {
					Conditions []struct{ Type, Status, Reason, Message string }
				}
			}
			err = json.NewDecoder(resp.Body).Decode(&node)
			resp.Body.Close()
			if err == nil && resp.StatusCode == 200 {
				for _, c := range node.Status.Conditions {
					if c.Type == "Ready" {
						if c.Status == "True" {
							return nil
						}
						last = fmt.Sprintf("Ready=%s: %s %s", c.Status, c.Reason, c.Message)
					}
				}
			}
		}
		select {
		case <-s.ctx.Done():
			return fmt.Errorf("supervisor stopping: %w", s.ctx.Err())
		case <-time.After(time.Second):
		}
	}
	return fmt.Errorf("node %s not Ready: %s", nodeName, last)
}

// run runs a host command, its output in the error.
func run(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// cmdNode: harness node import --state DIR FILE...: imports image archives
// (`harness image`) into the running node's containerd.
func cmdNode(args []string) error {
	if len(args) == 0 || args[0] != "import" {
		return fmt.Errorf("usage: harness node import --state DIR FILE...")
	}
	fs := flag.NewFlagSet("node import", flag.ContinueOnError)
	state := fs.String("state", "", "state directory (required)")
	if err := fs.Parse(args[1:]); err != nil {
		return err
	}
	files := fs.Args()
	if len(files) == 0 {
		return fmt.Errorf("node import: no archive named")
	}
	dir, err := stateDir(*state)
	if err != nil {
		return err
	}
	n := &node{dir: filepath.Join(dir, "node")}
	if _, err := os.Stat(filepath.Join(n.dir, "containerd.sock")); err != nil {
		return fmt.Errorf("no node runs for %s (start it with up --node): %w", dir, err)
	}
	for _, f := range files {
		if err := n.importArchive(f); err != nil {
			return err
		}
	}
	return nil
}
