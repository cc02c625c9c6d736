package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/client-go/util/retry"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/ptr"
)

const (
	// jobsNodeName is the management cluster's one simulated node, where
	// the Pods of Jobs run (without a real node) and the VMs' hot-plug
	// attachment Pods are bound.
	jobsNodeName = "sim-management"
	// simulatedTaint keeps the scheduler from placing a real Pod on the
	// simulated node when a real node runs beside it; nothing schedules
	// there otherwise (the Pods it holds are bound to it by name).
	simulatedTaint = "volume-gate.test/simulated"
	// jobNameLabel marks the Pods the Job controller creates.
	jobNameLabel = "batch.kubernetes.io/job-name"
	// jobTokenTTL is the lifetime of the ServiceAccount token a Pod's
	// script runs with (a projected token's default).
	jobTokenTTL = time.Hour
)

// jobs plays the management cluster's scheduler and kubelet for the Pods of
// Jobs, which is how Helm runs a chart's hooks: the real Job controller
// creates the Pods; here they are bound to the node `sim-management`, and a
// Pod whose container runs a shell (`/bin/sh -c SCRIPT`) runs that script as
// a local process with `kubectl` (this harness) on PATH, authenticated as the
// Pod's ServiceAccount with a token bound to the Pod (TokenRequest). Its exit
// status becomes the Pod's phase, so the Job controller, and Helm waiting on
// the Job, see success or failure. Its output goes to the log, line by line.
type jobs struct {
	s    *sim
	pods corelisters.PodLister
	q    workqueue.TypedRateLimitingInterface[string]
	// bin holds `kubectl`, a link to the kubectl beside this harness;
	// work holds one directory per running Pod (its HOME and kubeconfig).
	bin, work string

	mu      sync.Mutex
	running map[types.UID]*jobProcess
}

type jobProcess struct {
	cmd  *exec.Cmd
	done chan struct{}
}

// runManagementNode registers the simulated management node and keeps its
// heartbeat until ctx ends: without it the pod GC controller deletes the
// Pods bound to it (orphaned, after 40 s), the hot-plug attachment Pods
// among them. It carries the NoSchedule taint simulatedTaint.
func (s *sim) runManagementNode(ctx context.Context) {
	taint := func(n *corev1.Node) {
		if !slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == simulatedTaint }) {
			n.Spec.Taints = append(n.Spec.Taints, corev1.Taint{Key: simulatedTaint, Value: "true", Effect: corev1.TaintEffectNoSchedule})
		}
	}
	beat := func() {
		err := beatNode(ctx, s.mgmt, jobsNodeName, func() {
			s.log.printf("sim", "", "registered", "node %s in the management cluster", jobsNodeName)
		}, taint)
		if err != nil && ctx.Err() == nil {
			s.log.printf("sim", "", "error", "heartbeat of node %s: %v", jobsNodeName, err)
		}
	}
	beat()
	every(ctx, s.cfg.heartbeat, beat)
}

func newJobs(s *sim) (*jobs, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find the harness binary for kubectl: %w", err)
	}
	kubectl, err := kubectlBeside(self)
	if err != nil {
		return nil, err
	}
	root := s.cfg.jobsDir
	if root == "" {
		if root, err = os.MkdirTemp("", "volume-gate-sim-jobs-"); err != nil {
			return nil, err
		}
	} else if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, err
	}
	j := &jobs{s: s, bin: filepath.Join(root, "bin"), work: filepath.Join(root, "pods"), running: map[types.UID]*jobProcess{}}
	for _, d := range []string{j.bin, j.work} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
	}
	if err := os.Symlink(kubectl, filepath.Join(j.bin, "kubectl")); err != nil {
		return nil, fmt.Errorf("link kubectl: %w", err)
	}
	return j, nil
}

func (j *jobs) logf(pod *corev1.Pod, action, format string, args ...any) {
	j.s.log.printf("job", pod.Namespace+"/"+pod.Labels[jobNameLabel], action, "pod %s: "+format, append([]any{pod.Name}, args...)...)
}

func (j *jobs) run(ctx context.Context) {
	defer os.RemoveAll(filepath.Dir(j.bin))
	j.q = newItemQueue("jobs")
	defer j.q.ShutDown()
	factory := informers.NewSharedInformerFactoryWithOptions(j.s.mgmt, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = jobNameLabel }))
	inf := factory.Core().V1().Pods()
	j.pods = inf.Lister()
	enqueue := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			j.q.Add(key)
		}
	}
	inf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    enqueue,
		UpdateFunc: func(_, obj any) { enqueue(obj) },
		DeleteFunc: func(obj any) {
			if pod, ok := tombstone(obj).(*corev1.Pod); ok {
				j.kill(pod.UID)
			}
		},
	})
	factory.Start(ctx.Done())
	defer factory.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), inf.Informer().HasSynced) {
		return
	}
	j.s.log.printf("job", "", "watching", "Pods of Jobs in the management cluster (node %s)", jobsNodeName)
	go func() {
		<-ctx.Done()
		j.q.ShutDown()
	}()
	for j.processNext(ctx) {
	}
	j.mu.Lock()
	uids := slices.Collect(maps.Keys(j.running))
	j.mu.Unlock()
	for _, uid := range uids {
		j.kill(uid)
	}
}

func (j *jobs) processNext(ctx context.Context) bool {
	key, quit := j.q.Get()
	if quit {
		return false
	}
	defer j.q.Done(key)
	if err := j.sync(ctx, key); err != nil && ctx.Err() == nil {
		j.s.log.printf("job", "", "error", "pod %s: %v (retrying)", key, err)
		j.q.AddRateLimited(key)
		return true
	}
	j.q.Forget(key)
	return true
}

func (j *jobs) sync(ctx context.Context, key string) error {
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	pod, err := j.pods.Pods(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil || !j.s.inScope(ns) {
		return err
	}
	switch {
	case pod.DeletionTimestamp != nil:
		// A kubelet stops the containers, then confirms the deletion.
		j.kill(pod.UID)
		opts := metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0), Preconditions: &metav1.Preconditions{UID: &pod.UID}}
		if err := j.s.mgmt.CoreV1().Pods(ns).Delete(ctx, name, opts); err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			return err
		}
		return nil
	case pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed:
		return nil
	case pod.Spec.NodeName == "":
		binding := &corev1.Binding{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, UID: pod.UID},
			Target: corev1.ObjectReference{Kind: "Node", Name: jobsNodeName}}
		err := j.s.mgmt.CoreV1().Pods(ns).Bind(ctx, binding, metav1.CreateOptions{})
		if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
			return nil
		}
		return err
	case pod.Spec.NodeName != jobsNodeName:
		return nil
	}
	j.mu.Lock()
	_, started := j.running[pod.UID]
	j.mu.Unlock()
	if started {
		return nil
	}
	if pod.Status.Phase == corev1.PodRunning {
		// Running, but not here: the simulator restarted under it.
		return j.finish(ctx, pod, 137, "the simulator restarted while the Pod ran")
	}
	return j.start(ctx, pod)
}

// imageRepository is an image reference without its tag or digest.
func imageRepository(image string) string {
	if at := strings.IndexByte(image, '@'); at >= 0 {
		image = image[:at]
	}
	if colon := strings.LastIndexByte(image, ':'); colon > strings.LastIndexByte(image, '/') {
		image = image[:colon]
	}
	return image
}

// start runs the Pod's first container as a local process: a shell script,
// or, in an image whose program this machine has (--image-binary), that
// program with the container's arguments.
func (j *jobs) start(ctx context.Context, pod *corev1.Pod) error {
	c := pod.Spec.Containers[0]
	argv := append(slices.Clone(c.Command), c.Args...)
	program, ownImage := j.s.cfg.imageBinaries[imageRepository(c.Image)]
	switch {
	case ownImage && len(c.Command) == 0:
		argv = append([]string{program}, c.Args...)
	case len(argv) > 0 && (argv[0] == "/bin/sh" || argv[0] == "sh"):
		argv[0] = "/bin/sh"
	default:
		return j.finish(ctx, pod, 126, fmt.Sprintf("container %s: the simulator runs only shell commands (/bin/sh), or the entrypoint of an image given with --image-binary, not %q in %s", c.Name, argv, c.Image))
	}
	dir := filepath.Join(j.work, string(pod.UID))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	kubeconfig, err := j.kubeconfig(ctx, pod, dir)
	if err != nil {
		return j.finish(ctx, pod, 1, err.Error())
	}
	var env []string
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			env = append(env, e.Name+"="+e.Value)
		}
	}
	// The container's image is not pulled: its tools are this machine's,
	// with kubectl (built beside the harness) first on PATH.
	env = append(env, "PATH="+j.bin+":/usr/local/bin:/usr/bin:/bin", "HOME="+dir, "KUBECONFIG="+kubeconfig)
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir, cmd.Env = dir, env
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	cmd.Stderr = cmd.Stdout
	if err := j.setRunning(ctx, pod); err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return j.finish(ctx, pod, 127, fmt.Sprintf("start %s: %v", argv[0], err))
	}
	p := &jobProcess{cmd: cmd, done: make(chan struct{})}
	j.mu.Lock()
	j.running[pod.UID] = p
	j.mu.Unlock()
	j.logf(pod, "running", "%s runs its script as ServiceAccount %s", c.Name, serviceAccountOf(pod))
	go func() {
		defer close(p.done)
		j.copyOutput(pod, out)
		err := cmd.Wait()
		code := 0
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			code = exit.ExitCode()
			if code < 0 {
				code = 137 // killed by a signal
			}
		} else if err != nil {
			code = 1
		}
		os.RemoveAll(dir)
		j.mu.Lock()
		delete(j.running, pod.UID)
		j.mu.Unlock()
		if ctx.Err() != nil {
			return
		}
		if err := j.finish(context.Background(), pod, code, ""); err != nil {
			j.logf(pod, "error", "report exit %d: %v", code, err)
		}
	}()
	return nil
}

func (j *jobs) copyOutput(pod *corev1.Pod, r io.Reader) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		j.logf(pod, "output", "%s", sc.Text())
	}
}

func serviceAccountOf(pod *corev1.Pod) string {
	if pod.Spec.ServiceAccountName != "" {
		return pod.Spec.ServiceAccountName
	}
	return "default"
}

// kubeconfig writes a kubeconfig for the management API with a token of
// the Pod's ServiceAccount, bound to the Pod, and returns its path.
func (j *jobs) kubeconfig(ctx context.Context, pod *corev1.Pod, dir string) (string, error) {
	sa := serviceAccountOf(pod)
	tr, err := j.s.mgmt.CoreV1().ServiceAccounts(pod.Namespace).CreateToken(ctx, sa, &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
		ExpirationSeconds: ptr.To(int64(jobTokenTTL / time.Second)),
		BoundObjectRef:    &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("token for ServiceAccount %s/%s: %w", pod.Namespace, sa, err)
	}
	ca := j.s.restCfg.CAData
	if len(ca) == 0 && j.s.restCfg.CAFile != "" {
		if ca, err = os.ReadFile(j.s.restCfg.CAFile); err != nil {
			return "", fmt.Errorf("read the management CA: %w", err)
		}
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["management"] = &clientcmdapi.Cluster{Server: j.s.restCfg.Host, CertificateAuthorityData: ca}
	cfg.AuthInfos["pod"] = &clientcmdapi.AuthInfo{Token: tr.Status.Token}
	cfg.Contexts["pod"] = &clientcmdapi.Context{Cluster: "management", AuthInfo: "pod", Namespace: pod.Namespace}
	cfg.CurrentContext = "pod"
	path := filepath.Join(dir, "kubeconfig")
	return path, clientcmd.WriteToFile(*cfg, path)
}

// kill stops the process of Pod uid, if it runs, and waits for it.
func (j *jobs) kill(uid types.UID) {
	j.mu.Lock()
	p := j.running[uid]
	j.mu.Unlock()
	if p == nil {
		return
	}
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	<-p.done
}

func (j *jobs) setRunning(ctx context.Context, pod *corev1.Pod) error {
	pod = pod.DeepCopy()
	st := &pod.Status
	st.HostIP, st.HostIPs = simNodeIP, []corev1.HostIP{{IP: simNodeIP}}
	st.PodIP, st.PodIPs = simNodeIP, []corev1.PodIP{{IP: simNodeIP}}
	markRunning(pod, metav1.Now())
	_, err := j.s.mgmt.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, pod, metav1.UpdateOptions{})
	return err
}

// finish reports the Pod's container exited with code: Succeeded for 0,
// Failed otherwise (a Job's Pods never restart here: restartPolicy Never).
func (j *jobs) finish(ctx context.Context, pod *corev1.Pod, code int, message string) error {
	phase, reason := corev1.PodSucceeded, "Completed"
	if code != 0 {
		phase, reason = corev1.PodFailed, "Error"
	}
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := j.s.mgmt.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if cur.UID != pod.UID {
			return nil
		}
		now := metav1.Now()
		st := &cur.Status
		st.Phase, st.Message = phase, message
		if st.StartTime == nil {
			st.StartTime = &now
		}
		for i := range st.Conditions {
			if t := st.Conditions[i].Type; t == corev1.PodReady || t == corev1.ContainersReady {
				st.Conditions[i].Status, st.Conditions[i].Reason, st.Conditions[i].LastTransitionTime = corev1.ConditionFalse, "PodCompleted", now
			}
		}
		st.ContainerStatuses = nil
		for _, c := range cur.Spec.Containers {
			st.ContainerStatuses = append(st.ContainerStatuses, corev1.ContainerStatus{
				Name: c.Name, Image: c.Image, ImageID: "sim://" + c.Image, ContainerID: "sim://" + string(cur.UID) + "/" + c.Name,
				Started: ptr.To(false),
				State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
					ExitCode: int32(code), Reason: reason, Message: message, FinishedAt: now, StartedAt: *st.StartTime,
				}},
			})
		}
		_, err = j.s.mgmt.CoreV1().Pods(cur.Namespace).UpdateStatus(ctx, cur, metav1.UpdateOptions{})
		return err
	})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err == nil {
		if message != "" {
			j.logf(pod, "exited", "exit %d (%s): %s", code, phase, message)
		} else {
			j.logf(pod, "exited", "exit %d (%s)", code, phase)
		}
	}
	return err
}
