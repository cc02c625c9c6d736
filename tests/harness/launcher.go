package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"github.com/cozystack/volume-gate/tests/harness/liveness"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"
)

const defaultTimeout = 180 * time.Second

// names is a repeatable string flag.
type names []string

func (n *names) String() string     { return strings.Join(*n, ",") }
func (n *names) Set(v string) error { *n = append(*n, v); return nil }

// cmdUp starts a supervisor for the state directory unless one is running,
// waits until its clusters are ready and prints their environment.
func cmdUp(args []string) error {
	fs := flag.NewFlagSet("up", flag.ContinueOnError)
	state := fs.String("state", "", "state directory (required)")
	owner := fs.Int("owner-pid", 0, "stop everything once this process is gone")
	timeout := fs.Duration("timeout", defaultTimeout, "how long to wait for each cluster")
	removeState := fs.Bool("remove-state", false, "once the supervisor has stopped everything, remove DIR, unless DIR/"+keepStateFile+" or DIR/failed exists or "+keepStateEnv+" is set (a test run that passed leaves nothing behind)")
	withNode := fs.Bool("node", false, "run a real node for the management cluster: the kubelet, containerd and runc, a CNI bridge (root; see node.go)")
	var tenants names
	fs.Var(&tenants, "tenant", "tenant cluster to run besides management (repeatable; default: tenant)")
	if _, err := parseArgs(fs, args, 0); err != nil {
		return err
	}
	dir, err := stateDir(*state)
	if err != nil {
		return err
	}
	if len(tenants) == 0 {
		tenants = names{"tenant"}
	}
	clusters := append([]string{managementCluster}, tenants...)
	for _, name := range clusters {
		if !validName(name) {
			return errInvalidName(name)
		}
	}
	if err := os.MkdirAll(filepath.Join(dir, "logs"), 0o755); err != nil {
		return err
	}
	// Concurrent `up`s (parallel test binaries) must share one supervisor.
	lock, err := lockFile(filepath.Join(dir, "up.lock"), true)
	if err != nil {
		return err
	}
	defer lock.Close()

	pid, running := supervisorPID(dir)
	var started *liveness.Child
	if !running {
		if err := ensurePKI(filepath.Join(dir, "pki")); err != nil {
			return fmt.Errorf("generate PKI in %s: %w", filepath.Join(dir, "pki"), err)
		}
		for _, f := range []string{"ready", "failed", "control.addr"} {
			os.Remove(filepath.Join(dir, f))
		}
		if *withNode {
			// Before anything starts: a machine that cannot run a node says what it lacks.
			if err := nodePreflight(); err != nil {
				return err
			}
		}
		if started, err = startSupervisor(dir, *owner, *timeout, *removeState, *withNode, clusters); err != nil {
			return err
		}
		pid = started.Pid()
	}
	if err := waitSupervisor(dir, pid, started, *timeout+30*time.Second); err != nil {
		return err
	}
	// A supervisor that was already running may lack a requested cluster.
	for _, name := range clusters {
		if _, err := control(dir, http.MethodPost, name); err != nil {
			return err
		}
	}
	return printEnv(os.Stdout, dir)
}

func startSupervisor(dir string, owner int, timeout time.Duration, removeState, withNode bool, clusters []string) (*liveness.Child, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	logPath := filepath.Join(dir, "logs", "supervisor.log")
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer logFile.Close()
	args := []string{"supervise", "--state", dir, "--timeout", timeout.String()}
	cmd := exec.Command(self)
	if owner != 0 {
		// The owner is our caller, alive while it waits for us: take a pidfd
		// on it now and hand it down, so the supervisor follows that very
		// process (no /proc polling, no PID reuse) from its first instant.
		h, err := liveness.Open(owner)
		if err != nil {
			return nil, fmt.Errorf("--owner-pid %d: %w", owner, err)
		}
		pidfd := h.File()
		defer pidfd.Close()
		cmd.ExtraFiles = []*os.File{pidfd}
		args = append(args, "--owner-pid", strconv.Itoa(owner), "--owner-pidfd", "3")
	}
	if removeState {
		args = append(args, "--remove-state")
	}
	if withNode {
		args = append(args, "--node")
	}
	for _, name := range clusters {
		args = append(args, "--cluster", name)
	}
	cmd.Args = append(cmd.Args, args...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// A session of its own: the supervisor outlives this command and gets no
	// signal meant for the caller's terminal or process group.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	child, err := liveness.Start(cmd)
	if err != nil {
		return nil, fmt.Errorf("start supervisor: %w", err)
	}
	return child, nil
}

// waitSupervisor waits until the supervisor reports ready. On failure or
// timeout it stops the supervisor, so nothing is left running. Whether a
// supervisor this command started is alive is known from its exit alone:
// its /proc command line can read empty for a moment after it starts.
func waitSupervisor(dir string, pid int, started *liveness.Child, timeout time.Duration) error {
	logPath := filepath.Join(dir, "logs", "supervisor.log")
	deadline := time.Now().Add(timeout)
	for {
		if _, err := os.Stat(filepath.Join(dir, "ready")); err == nil {
			return nil
		}
		if msg, err := os.ReadFile(filepath.Join(dir, "failed")); err == nil {
			stopSupervisor(dir, pid)
			return fmt.Errorf("control plane failed to start: %s(supervisor log: %s)", msg, logPath)
		}
		var gone bool
		if started != nil {
			gone = !started.Alive()
		} else {
			gone = !isOurSupervisor(pid, dir)
		}
		if gone {
			return fmt.Errorf("supervisor (pid %d) exited before it was ready\n--- last lines of %s ---\n%s", pid, logPath, tail(logPath, 25))
		}
		if time.Now().After(deadline) {
			stopSupervisor(dir, pid)
			return fmt.Errorf("supervisor (pid %d) not ready after %s\n--- last lines of %s ---\n%s", pid, timeout, logPath, tail(logPath, 25))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func cmdDown(args []string) error {
	fs := flag.NewFlagSet("down", flag.ContinueOnError)
	state := fs.String("state", "", "state directory (required)")
	if _, err := parseArgs(fs, args, 0); err != nil {
		return err
	}
	dir, err := stateDir(*state)
	if err != nil {
		return err
	}
	pid, running := supervisorPID(dir)
	if !running {
		return nil
	}
	return stopSupervisor(dir, pid)
}

// stopSupervisor SIGTERMs the supervisor and waits until it is gone. Its
// components get stopGrace each, clusters in parallel, then etcd.
func stopSupervisor(dir string, pid int) error {
	syscall.Kill(pid, syscall.SIGTERM)
	if waitGone(pid, dir, 3*stopGrace+10*time.Second) {
		return nil
	}
	// The components die with it (Pdeathsig).
	syscall.Kill(pid, syscall.SIGKILL)
	waitGone(pid, dir, 5*time.Second)
	return fmt.Errorf("supervisor (pid %d) ignored SIGTERM; killed it (see %s)", pid, filepath.Join(dir, "logs", "supervisor.log"))
}

func waitGone(pid int, dir string, timeout time.Duration) bool {
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if !isOurSupervisor(pid, dir) {
			return true
		}
	}
	return false
}

func cmdEnv(args []string) error {
	fs := flag.NewFlagSet("env", flag.ContinueOnError)
	state := fs.String("state", "", "state directory (required)")
	if _, err := parseArgs(fs, args, 0); err != nil {
		return err
	}
	dir, err := stateDir(*state)
	if err != nil {
		return err
	}
	return printEnv(os.Stdout, dir)
}

func printEnv(w io.Writer, dir string) error {
	addr, err := controlAddr(dir)
	if err != nil {
		return err
	}
	body, err := request(http.MethodGet, addr+"/clusters")
	if err != nil {
		return err
	}
	var clusters []clusterInfo
	if err := json.Unmarshal(body, &clusters); err != nil {
		return fmt.Errorf("GET %s/clusters: %w", addr, err)
	}
	for _, c := range clusters {
		envName := strings.ToUpper(strings.ReplaceAll(c.Name, "-", "_"))
		fmt.Fprintf(w, "export %s_KUBECONFIG=%s\n", envName, shellQuote(c.Kubeconfig))
	}
	fmt.Fprintf(w, "export HARNESS_CONTROL=%s\n", shellQuote(addr))
	fmt.Fprintf(w, "export HARNESS_STATE=%s\n", shellQuote(dir))
	return nil
}

func cmdCluster(args []string) error {
	fs := flag.NewFlagSet("cluster", flag.ContinueOnError)
	state := fs.String("state", "", "state directory (required)")
	light := fs.Bool("light", false, "up: a light tenant cluster (fewer APIs and controllers, no scheduler)")
	pod := fs.Bool("pod", false, "up: prepare the cluster for Pods to run (its ports, PKI and kubeconfig), and print its components' command lines (`commands`) instead of running them")
	pos, err := parseArgs(fs, args, 2)
	if err != nil {
		return err
	}
	dir, err := stateDir(*state)
	if err != nil {
		return err
	}
	verb, name := pos[0], pos[1]
	if !validName(name) {
		return errInvalidName(name)
	}
	switch verb {
	case "up":
		var query []string
		if *light {
			query = append(query, "profile=light")
		}
		if *pod {
			query = append(query, "run=pod")
		}
		target := name
		if len(query) > 0 {
			target += "?" + strings.Join(query, "&")
		}
		body, err := control(dir, http.MethodPost, target)
		if err != nil {
			return err
		}
		os.Stdout.Write(body)
		return nil
	case "down":
		_, err := control(dir, http.MethodDelete, name)
		return err
	default:
		return fmt.Errorf("unknown verb %q: want up or down", verb)
	}
}

// control calls the supervisor's control API for cluster name.
func control(dir, method, name string) ([]byte, error) {
	addr, err := controlAddr(dir)
	if err != nil {
		return nil, err
	}
	return request(method, addr+"/clusters/"+name)
}

func request(method, url string) ([]byte, error) {
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		return nil, err
	}
	// Starting a cluster takes as long as the supervisor's --timeout allows.
	client := &http.Client{Timeout: 10 * time.Minute, Transport: &http.Transport{Proxy: nil}}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode/100 != 2 {
		return nil, fmt.Errorf("%s %s: %s: %s", method, url, resp.Status, strings.TrimSpace(string(body)))
	}
	return body, nil
}

func controlAddr(dir string) (string, error) {
	if _, running := supervisorPID(dir); !running {
		return "", fmt.Errorf("no supervisor running for %s (run: harness up --state %s)", dir, dir)
	}
	b, err := os.ReadFile(filepath.Join(dir, "control.addr"))
	if err != nil {
		return "", fmt.Errorf("supervisor is starting, no control API yet: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}

// supervisorPID returns the PID in DIR/supervisor.pid if that process is
// our supervisor for dir.
func supervisorPID(dir string) (int, bool) {
	b, err := os.ReadFile(filepath.Join(dir, "supervisor.pid"))
	if err != nil {
		return 0, false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return 0, false
	}
	return pid, isOurSupervisor(pid, dir)
}

// isOurSupervisor reports whether pid runs `harness supervise --state dir`;
// it guards against signalling a process that reused a stale PID.
//
// It is for a supervisor found by its pid file, which has run long enough to
// write it; an empty command line (a zombie) counts as not ours.
func isOurSupervisor(pid int, dir string) bool {
	args, err := liveness.Cmdline(pid)
	if err != nil {
		return false
	}
	if len(args) < 2 || args[1] != "supervise" {
		return false
	}
	for i, a := range args {
		if a == "--state="+dir || (a == "--state" && i+1 < len(args) && args[i+1] == dir) {
			return true
		}
	}
	return false
}

// parseArgs parses flags that may follow positional arguments and checks
// that there are exactly npos of those.
func parseArgs(fs *flag.FlagSet, args []string, npos int) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			break
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
	if len(pos) != npos {
		return nil, fmt.Errorf("want %d positional arguments, got %q", npos, pos)
	}
	return pos, nil
}

func stateDir(state string) (string, error) {
	if state == "" {
		return "", errors.New("--state DIR is required")
	}
	return filepath.Abs(state)
}

var nameRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$`)

func validName(name string) bool { return nameRE.MatchString(name) }

func errInvalidName(name string) error {
	return fmt.Errorf("invalid cluster name %q: want lowercase letters, digits and dashes", name)
}

func lockFile(path string, block bool) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	how := syscall.LOCK_EX
	if !block {
		how |= syscall.LOCK_NB
	}
	if err := syscall.Flock(int(f.Fd()), how); err != nil {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return f, nil
}

func writeFileAtomic(path string, data []byte, perm os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(perm); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// tail returns the last n lines of the file at path.
func tail(path string, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return "(" + err.Error() + ")"
	}
	defer f.Close()
	const window = 16 << 10
	if fi, err := f.Stat(); err == nil && fi.Size() > window {
		f.Seek(-window, io.SeekEnd)
	}
	b, _ := io.ReadAll(f)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

var shellSafe = regexp.MustCompile(`^[A-Za-z0-9_./:@%+,=-]+$`)

func shellQuote(s string) string {
	if shellSafe.MatchString(s) {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
