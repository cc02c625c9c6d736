package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/retry"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/ptr"
)

const (
	simNodeName = "sim-node"
	simNodeIP   = "127.0.0.1"
	// leaseDuration is what a kubelet writes (40 s); the heartbeat renews it
	// well within, so the node-lifecycle controller never marks it unknown.
	leaseDuration = 40
)

// kubelet runs the one fake Node of a tenant cluster: it keeps the Node
// Ready and its Lease fresh, starts the Pods bound to it (once their claims
// are bound and the driver can mount them), and confirms the termination of
// deleted Pods after their (capped) grace period, as a kubelet does, so that
// kubernetes.io/pvc-protection behaves as on a real cluster.
type kubelet struct {
	t  *tenant
	cs kubernetes.Interface
	// vm is the VirtualMachine this node is (the driver's node ID names it).
	vm       string
	graceCap time.Duration
	q        workqueue.TypedRateLimitingInterface[string]

	pods corelisters.PodLister
	pvcs corelisters.PersistentVolumeClaimLister
	pvs  corelisters.PersistentVolumeLister
	vas  storagelisters.VolumeAttachmentLister

	// synced is set once the caches are, for the heartbeat goroutine.
	synced atomic.Bool
	// inUse is the volumes last reported in node.status.volumesInUse.
	// Guarded by inUseMu: the worker and the heartbeat both report.
	inUseMu sync.Mutex
	inUse   []corev1.UniqueVolumeName

	// Owned by the single worker goroutine.
	nextIP  int
	waiting map[types.UID]string // last logged reason a Pod is not started
	// Owned by the heartbeat goroutine.
	heartbeatErr string
}

func newKubelet(t *tenant, cs kubernetes.Interface, vm string) *kubelet {
	return &kubelet{t: t, cs: cs, vm: vm, graceCap: t.s.cfg.graceCap, waiting: map[types.UID]string{}}
}

func (k *kubelet) run(ctx context.Context) {
	k.q = newItemQueue("kubelet")
	defer k.q.ShutDown()
	k.registerDriver(ctx)
	k.heartbeat(ctx) // registers the Node before any Pod can be bound to it
	k.registerCSINode(ctx)
	go every(ctx, k.t.s.cfg.heartbeat, func() { k.heartbeat(ctx) })

	// Only the Pods bound to this node, as a kubelet watches them. The
	// resync re-checks Pods waiting for the driver, whose state is not an
	// event in the tenant cluster.
	podFactory := informers.NewSharedInformerFactoryWithOptions(k.cs, 10*time.Second,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", simNodeName).String()
		}))
	volFactory := informers.NewSharedInformerFactory(k.cs, 0)
	podInf := podFactory.Core().V1().Pods()
	pvcInf := volFactory.Core().V1().PersistentVolumeClaims()
	pvInf := volFactory.Core().V1().PersistentVolumes()
	vaInf := volFactory.Storage().V1().VolumeAttachments()
	k.pods, k.pvcs, k.pvs, k.vas = podInf.Lister(), pvcInf.Lister(), pvInf.Lister(), vaInf.Lister()

	enqueue := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			k.q.Add(key)
		}
	}
	podInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    enqueue,
		UpdateFunc: func(_, obj any) { enqueue(obj) },
		// A Pod gone releases its volumes (volumesInUse).
		DeleteFunc: enqueue,
	})
	// A Pod waiting for its volume to be attached starts when it is.
	vaInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { k.attachmentChanged(obj) },
		UpdateFunc: func(_, obj any) { k.attachmentChanged(obj) },
	})
	// A Pod waiting for its claim starts when the claim is bound.
	pvcInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { k.claimChanged(obj) },
		UpdateFunc: func(_, obj any) { k.claimChanged(obj) },
	})
	podFactory.Start(ctx.Done())
	volFactory.Start(ctx.Done())
	defer podFactory.Shutdown()
	defer volFactory.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), podInf.Informer().HasSynced, pvcInf.Informer().HasSynced, pvInf.Informer().HasSynced, vaInf.Informer().HasSynced) {
		return
	}
	k.synced.Store(true)
	go func() {
		<-ctx.Done()
		k.q.ShutDown()
	}()
	for k.processNext(ctx) {
	}
}

func (k *kubelet) claimChanged(obj any) {
	pvc, ok := obj.(*corev1.PersistentVolumeClaim)
	if !ok || k.pods == nil {
		return
	}
	pods, _ := k.pods.Pods(pvc.Namespace).List(labels.Everything())
	for _, p := range pods {
		for _, c := range podClaims(p) {
			if c == pvc.Name {
				k.q.Add(p.Namespace + "/" + p.Name)
				break
			}
		}
	}
}

func (k *kubelet) processNext(ctx context.Context) bool {
	key, quit := k.q.Get()
	if quit {
		return false
	}
	defer k.q.Done(key)
	err := k.syncPod(ctx, key)
	if err == nil {
		err = k.reportInUse(ctx)
	}
	if err != nil && ctx.Err() == nil {
		k.t.logf("kubelet", "error", "pod %s: %v (retrying)", key, err)
		k.q.AddRateLimited(key)
		return true
	}
	k.q.Forget(key)
	return true
}

func (k *kubelet) syncPod(ctx context.Context, key string) error {
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	pod, err := k.pods.Pods(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if pod.DeletionTimestamp != nil {
		return k.terminate(ctx, pod)
	}
	if pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed || podStarted(pod) {
		return nil
	}
	if why := k.volumesNotReady(pod); why != "" {
		if k.waiting[pod.UID] != why {
			k.waiting[pod.UID] = why
			k.t.logf("kubelet", "waiting", "pod %s: %s", key, why)
		}
		return nil
	}
	delete(k.waiting, pod.UID)
	return k.start(ctx, pod)
}

// terminate confirms a deleted Pod gone once its grace period, capped by
// --grace-cap, has passed since the deletion was requested.
func (k *kubelet) terminate(ctx context.Context, pod *corev1.Pod) error {
	grace := time.Duration(ptr.Deref(pod.DeletionGracePeriodSeconds, 0)) * time.Second
	requested := pod.DeletionTimestamp.Add(-grace)
	due := requested.Add(min(grace, k.graceCap))
	if wait := time.Until(due); wait > 0 {
		k.q.AddAfter(pod.Namespace+"/"+pod.Name, wait)
		return nil
	}
	opts := metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0), Preconditions: &metav1.Preconditions{UID: &pod.UID}}
	err := k.cs.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, opts)
	if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
		return nil
	}
	if err != nil {
		return err
	}
	delete(k.waiting, pod.UID)
	k.t.logf("kubelet", "terminated", "pod %s/%s after %s (grace %s, cap %s)",
		pod.Namespace, pod.Name, min(grace, k.graceCap), grace, k.graceCap)
	return nil
}

// podClaims lists the claims a Pod mounts, generic ephemeral volumes
// included (their claim is named <pod>-<volume>).
func podClaims(pod *corev1.Pod) []string {
	var claims []string
	for _, v := range pod.Spec.Volumes {
		switch {
		case v.PersistentVolumeClaim != nil:
			claims = append(claims, v.PersistentVolumeClaim.ClaimName)
		case v.Ephemeral != nil:
			claims = append(claims, pod.Name+"-"+v.Name)
		}
	}
	return claims
}

// volumesNotReady says why the Pod's volumes cannot be mounted yet, or "".
func (k *kubelet) volumesNotReady(pod *corev1.Pod) string {
	for _, claim := range podClaims(pod) {
		pvc, err := k.pvcs.PersistentVolumeClaims(pod.Namespace).Get(claim)
		switch {
		case err != nil:
			return fmt.Sprintf("claim %s not found", claim)
		case pvc.DeletionTimestamp != nil:
			return fmt.Sprintf("claim %s is being deleted", claim)
		case pvc.Status.Phase != corev1.ClaimBound || pvc.Spec.VolumeName == "":
			return fmt.Sprintf("claim %s is not bound", claim)
		}
		pv, err := k.pvs.Get(pvc.Spec.VolumeName)
		if err != nil {
			return fmt.Sprintf("volume %s of claim %s not found", pvc.Spec.VolumeName, claim)
		}
		if pv.Spec.CSI != nil && pv.Spec.CSI.Driver == k.t.s.cfg.driver {
			if !k.t.driverActive.Load() {
				return fmt.Sprintf("cannot mount %s: driver %s is not registered on the node", pv.Name, pv.Spec.CSI.Driver)
			}
			if why := k.notAttached(pv); why != "" {
				return why
			}
		}
	}
	return ""
}

func podStarted(pod *corev1.Pod) bool {
	if pod.Status.Phase != corev1.PodRunning || len(pod.Status.ContainerStatuses) != len(pod.Spec.Containers) {
		return false
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// start reports the Pod Running and Ready with all containers running.
func (k *kubelet) start(ctx context.Context, pod *corev1.Pod) error {
	now := metav1.Now()
	pod = pod.DeepCopy()
	st := &pod.Status
	st.HostIP, st.HostIPs = simNodeIP, []corev1.HostIP{{IP: simNodeIP}}
	if st.PodIP == "" {
		ip := simNodeIP
		if !pod.Spec.HostNetwork {
			k.nextIP++
			ip = fmt.Sprintf("10.244.%d.%d", (k.nextIP/250)%256, k.nextIP%250+2)
		}
		st.PodIP, st.PodIPs = ip, []corev1.PodIP{{IP: ip}}
	}
	markRunning(pod, now)
	st.InitContainerStatuses = nil
	for _, c := range pod.Spec.InitContainers {
		st.InitContainerStatuses = append(st.InitContainerStatuses, corev1.ContainerStatus{
			Name: c.Name, Image: c.Image, ImageID: "sim://" + c.Image, ContainerID: "sim://" + string(pod.UID) + "/" + c.Name,
			Ready: true, Started: ptr.To(false),
			State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 0, Reason: "Completed", StartedAt: now, FinishedAt: now}},
		})
	}
	if _, err := k.cs.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
		if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
			return nil // a newer version is on its way through the informer
		}
		return err
	}
	k.t.logf("kubelet", "running", "pod %s/%s ip=%s claims=%v", pod.Namespace, pod.Name, st.PodIP, podClaims(pod))
	return nil
}

// markRunning sets pod's status to Running and Ready, every container
// running since now.
func markRunning(pod *corev1.Pod, now metav1.Time) {
	st := &pod.Status
	st.Phase = corev1.PodRunning
	if st.StartTime == nil {
		st.StartTime = &now
	}
	for _, t := range []corev1.PodConditionType{corev1.PodReadyToStartContainers, corev1.PodInitialized, corev1.ContainersReady, corev1.PodReady, corev1.PodScheduled} {
		setPodCondition(st, t, now)
	}
	st.ContainerStatuses = nil
	for _, c := range pod.Spec.Containers {
		st.ContainerStatuses = append(st.ContainerStatuses, corev1.ContainerStatus{
			Name: c.Name, Image: c.Image, ImageID: "sim://" + c.Image, ContainerID: "sim://" + string(pod.UID) + "/" + c.Name,
			Ready: true, Started: ptr.To(true),
			State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}},
		})
	}
}

func setPodCondition(st *corev1.PodStatus, t corev1.PodConditionType, now metav1.Time) {
	for i := range st.Conditions {
		if st.Conditions[i].Type == t {
			if st.Conditions[i].Status != corev1.ConditionTrue {
				st.Conditions[i].Status, st.Conditions[i].LastTransitionTime = corev1.ConditionTrue, now
				st.Conditions[i].Reason, st.Conditions[i].Message = "", ""
			}
			return
		}
	}
	st.Conditions = append(st.Conditions, corev1.PodCondition{Type: t, Status: corev1.ConditionTrue, LastTransitionTime: now})
}

// registerDriver creates the CSIDriver object, as the driver's chart does:
// attachRequired, as the KubeVirt driver's: the attach/detach controller
// makes a VolumeAttachment for each volume a Pod on a node uses, and the
// external-attacher has the driver attach it (sim_attach.go).
func (k *kubelet) registerDriver(ctx context.Context) {
	obj := &storagev1.CSIDriver{
		ObjectMeta: metav1.ObjectMeta{Name: k.t.s.cfg.driver},
		Spec: storagev1.CSIDriverSpec{
			AttachRequired:       ptr.To(true),
			PodInfoOnMount:       ptr.To(false),
			VolumeLifecycleModes: []storagev1.VolumeLifecycleMode{storagev1.VolumeLifecyclePersistent},
		},
	}
	_, err := k.cs.StorageV1().CSIDrivers().Create(ctx, obj, metav1.CreateOptions{})
	switch {
	case err == nil:
		k.t.logf("kubelet", "csidriver", "created CSIDriver %s (attachRequired=true)", obj.Name)
	case !apierrors.IsAlreadyExists(err):
		k.t.logf("kubelet", "error", "create CSIDriver %s: %v", obj.Name, err)
	}
}

// heartbeat registers the Node if needed, keeps its Ready condition fresh
// and renews its Lease, as a kubelet does every 10 s.
func (k *kubelet) heartbeat(ctx context.Context) {
	err := beatNode(ctx, k.cs, simNodeName, func() {
		k.t.logf("kubelet", "registered", "node %s (cpu 64, memory 256Gi, pods 500)", simNodeName)
	}, k.tenantNode)
	msg := ""
	if err != nil {
		msg = err.Error()
	}
	if msg != k.heartbeatErr && ctx.Err() == nil {
		if err != nil {
			k.t.logf("kubelet", "error", "heartbeat of node %s: %v", simNodeName, err)
		} else {
			k.t.logf("kubelet", "heartbeat", "node %s Ready, lease renewed (recovered)", simNodeName)
		}
	}
	k.heartbeatErr = msg
}

// beatNode is one heartbeat of Node `name`: it registers the Node if needed
// (calling registered), keeps its Ready condition fresh and renews its Lease.
// A non-nil edit sets what else this kubelet reports on the Node.
// every runs f every d until ctx ends.
func every(ctx context.Context, d time.Duration, f func()) {
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			f()
		}
	}
}

func beatNode(ctx context.Context, cs kubernetes.Interface, name string, registered func(), edit func(*corev1.Node)) error {
	// The node-lifecycle controller writes the Node too (taints, at first).
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error { return updateNodeOnce(ctx, cs, name, registered, edit) })
	if err != nil {
		return err
	}
	return renewLease(ctx, cs, name)
}

func updateNodeOnce(ctx context.Context, cs kubernetes.Interface, name string, registered func(), edit func(*corev1.Node)) error {
	nodes := cs.CoreV1().Nodes()
	node, err := nodes.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		node, err = nodes.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{
			Name: name,
			Labels: map[string]string{
				"kubernetes.io/hostname": name,
				"kubernetes.io/os":       "linux",
				"kubernetes.io/arch":     "amd64",
			},
		}}, metav1.CreateOptions{})
		if err == nil {
			registered()
		}
	}
	if err != nil {
		return err
	}
	if edit != nil {
		before := node.Annotations[annControllerManagedAttach]
		taints, providerID := len(node.Spec.Taints), node.Spec.ProviderID
		edit(node)
		if node.Annotations[annControllerManagedAttach] != before || len(node.Spec.Taints) != taints || node.Spec.ProviderID != providerID {
			if node, err = nodes.Update(ctx, node, metav1.UpdateOptions{}); err != nil {
				return err
			}
			edit(node)
		}
	}
	now := metav1.Now()
	resources := corev1.ResourceList{
		corev1.ResourceCPU:              resource.MustParse("64"),
		corev1.ResourceMemory:           resource.MustParse("256Gi"),
		corev1.ResourcePods:             resource.MustParse("500"),
		corev1.ResourceEphemeralStorage: resource.MustParse("1Ti"),
	}
	st := &node.Status
	st.Capacity, st.Allocatable = resources, resources
	st.Phase = corev1.NodeRunning
	st.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: simNodeIP}, {Type: corev1.NodeHostName, Address: name}}
	st.DaemonEndpoints = corev1.NodeDaemonEndpoints{KubeletEndpoint: corev1.DaemonEndpoint{Port: 10250}}
	st.NodeInfo = corev1.NodeSystemInfo{
		MachineID: "sim", SystemUUID: "sim", BootID: "sim", KernelVersion: "sim", OSImage: "volume-gate simulator",
		ContainerRuntimeVersion: "sim://1", KubeletVersion: "v1.37.2", OperatingSystem: "linux", Architecture: "amd64",
	}
	want := map[corev1.NodeConditionType]corev1.ConditionStatus{
		corev1.NodeReady: corev1.ConditionTrue, corev1.NodeMemoryPressure: corev1.ConditionFalse,
		corev1.NodeDiskPressure: corev1.ConditionFalse, corev1.NodePIDPressure: corev1.ConditionFalse,
	}
	reasons := map[corev1.NodeConditionType]string{
		corev1.NodeReady: "KubeletReady", corev1.NodeMemoryPressure: "KubeletHasSufficientMemory",
		corev1.NodeDiskPressure: "KubeletHasNoDiskPressure", corev1.NodePIDPressure: "KubeletHasSufficientPID",
	}
	for i := range st.Conditions {
		c := &st.Conditions[i]
		if status, ok := want[c.Type]; ok {
			if c.Status != status {
				c.Status, c.LastTransitionTime = status, now
			}
			c.Reason, c.Message, c.LastHeartbeatTime = reasons[c.Type], "simulated kubelet", now
			delete(want, c.Type)
		}
	}
	for t, status := range want {
		st.Conditions = append(st.Conditions, corev1.NodeCondition{
			Type: t, Status: status, Reason: reasons[t], Message: "simulated kubelet",
			LastHeartbeatTime: now, LastTransitionTime: now,
		})
	}
	_, err = nodes.UpdateStatus(ctx, node, metav1.UpdateOptions{})
	return err
}

func renewLease(ctx context.Context, cs kubernetes.Interface, name string) error {
	leases := cs.CoordinationV1().Leases(corev1.NamespaceNodeLease)
	now := metav1.NowMicro()
	lease, err := leases.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		node, err := cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		_, err = leases.Create(ctx, &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{
				Name: name, Namespace: corev1.NamespaceNodeLease,
				OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: node.Name, UID: node.UID}},
			},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(name), LeaseDurationSeconds: ptr.To[int32](leaseDuration), RenewTime: &now},
		}, metav1.CreateOptions{})
		return err
	}
	if err != nil {
		return err
	}
	lease.Spec.HolderIdentity, lease.Spec.LeaseDurationSeconds, lease.Spec.RenewTime = ptr.To(name), ptr.To[int32](leaseDuration), &now
	_, err = leases.Update(ctx, lease, metav1.UpdateOptions{})
	if apierrors.IsConflict(err) {
		return nil // someone else wrote it; renewed on the next beat
	}
	return err
}
