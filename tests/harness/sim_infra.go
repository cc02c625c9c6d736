package main

// The infra layer, as in Cozystack: a tenant volume is two layers. The
// tenant sees a PV of the KubeVirt CSI driver; its controller,
// R-kcsi-controller, runs in the management cluster in the tenant's
// namespace and, for every tenant volume, creates a CDI DataVolume there
// (named like the tenant PV, which is also the PV's volumeHandle, and
// labelled with the tenant's infra labels). CDI makes a PVC of the same
// name, owned by the DataVolume, and the management cluster's own storage
// provisions it: that disk is the one on the hypervisor, so here it is the
// ledger file. DeleteVolume deletes the DataVolume and returns; the disk is
// freed when the management PVC goes, which pvc-protection holds back while
// a Pod of the tenant's VM (its hotplug attachment Pod) still mounts it.
//
//	kcsiBackend      the tenant driver's Create/DeleteVolume (DataVolumes) and
//	                 ControllerPublish/Unpublish (virt-api's addvolume/removevolume), as R-kcsi
//	cdi              DataVolume -> PVC (owned by it, labels copied)
//	infra provisioner the management StorageClass's provisioner (the real external-provisioner
//	                 with a ledgerBackend plugin)
//	attachments      confirms the deletion of attachment Pods (their "kubelet")
//	sim_virt.go      the VM and VMI of the tenant's node, virt-api, the hotplug controller
//
// A tenant's node is a VM: a Cozystack tenant's, that of its KubevirtMachine
// (Cluster API's real chain MachineDeployment -> MachineSet -> Machine, and
// the played CAPK's KubevirtMachine -> VirtualMachine, sim_cozystack_capi.go);
// a played Cluster API cluster's, `<cluster>-vm`, owned by its
// MachineDeployment. The attachment Pods are owned by the VM's VMI, so
// garbage collection takes them with the VM. A tenant without one has no
// node, and its disks are never attached.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/ptr"
)

const (
	// infraDriverName provisions the management cluster's own disks.
	infraDriverName = "infra.volume-gate.test"
	// infraStorageClass is the management StorageClass the DataVolumes use
	// (Cozystack: the tenant's infraStorageClassName, "replicated").
	infraStorageClass = "sim-infra"
	// annDeleteAfterCompletion is what kubevirt-csi-driver puts on each
	// DataVolume it creates, so CDI keeps the DataVolume after the import.
	annDeleteAfterCompletion = "cdi.kubevirt.io/storage.deleteAfterCompletion"
	// attachmentLabel marks the hotplug attachment Pods of a VM.
	attachmentLabel = "kubevirt.io"
	attachmentValue = "hotplug-disk"
	// attachmentTenantLabel names the tenant whose VM an attachment Pod serves.
	attachmentTenantLabel = "harness.volume-gate.test/vm-of"
)

var gvrMachineDeployment = schema.GroupVersionResource{Group: "cluster.x-k8s.io", Version: "v1beta1", Resource: "machinedeployments"}

// infraLabels are the labels of R's infra objects (the profile's template).
func infraLabels(r string) map[string]string {
	out := map[string]string{}
	for k, v := range prof.infra.labels {
		out[k] = strings.ReplaceAll(v, tenantPlaceholder, r)
	}
	return out
}

// kcsiBackend is the tenant driver's storage when the platform has an
// infra layer: DataVolumes in the management cluster, created and deleted
// by the tenant's CSI controller, which runs there as R-kcsi-controller,
// with its own identity (ServiceAccount R-kcsi): Kubernetes' RBAC decides
// what it may do, and a refusal is the API server's own 403.
type kcsiBackend struct {
	t *tenant

	mu     sync.Mutex
	config *rest.Config
	dyn    dynamic.Interface
	rest   rest.Interface // for virt-api's subresources
}

// clients are the management API as R-kcsi.
func (b *kcsiBackend) clients(ctx context.Context) (dynamic.Interface, rest.Interface, error) {
	cfg, err := b.t.kcsiConfig(ctx)
	if err != nil {
		return nil, nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.config == nil || b.config.BearerToken != cfg.BearerToken {
		dyn, err := dynamic.NewForConfig(cfg)
		if err != nil {
			return nil, nil, err
		}
		cs, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			return nil, nil, err
		}
		b.config, b.dyn, b.rest = cfg, dyn, cs.Discovery().RESTClient()
	}
	return b.dyn, b.rest, nil
}

// dataVolumes is the DataVolume API as R-kcsi.
func (b *kcsiBackend) dataVolumes(ctx context.Context) (dynamic.ResourceInterface, error) {
	dyn, _, err := b.clients(ctx)
	if err != nil {
		return nil, err
	}
	return dyn.Resource(gvrDataVolume).Namespace(b.t.ns), nil
}

// refused notes an API refusal of the controller's identity: logged as
// identity-missing, and a token the API server no longer accepts is
// dropped so the next call asks for a new one.
func (b *kcsiBackend) refused(what string, err error) {
	t := b.t
	if apierrors.IsUnauthorized(err) {
		t.kcsi.mu.Lock()
		t.kcsi.token = ""
		t.kcsi.mu.Unlock()
	}
	if apierrors.IsUnauthorized(err) || apierrors.IsForbidden(err) {
		t.logf("driver", "identity-missing", "%s: %v", what, err)
	}
}

func (b *kcsiBackend) createVolume(ctx context.Context, name string, pvc *corev1.PersistentVolumeClaim, size resource.Quantity) (string, error) {
	t := b.t
	key := pvc.Namespace + "/" + pvc.Name
	dvs, err := b.dataVolumes(ctx)
	if err != nil {
		return "", fmt.Errorf("CreateVolume for claim %s: %w", key, err)
	}
	dv := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "cdi.kubevirt.io/v1beta1",
		"kind":       "DataVolume",
		"metadata": map[string]any{
			"name":        name,
			"namespace":   t.ns,
			"labels":      toAny(t.diskLabels()),
			"annotations": map[string]any{annDeleteAfterCompletion: "false"},
		},
		"spec": map[string]any{
			"source": map[string]any{"blank": map[string]any{}},
			"storage": map[string]any{
				"accessModes":      []any{"ReadWriteOnce"},
				"resources":        map[string]any{"requests": map[string]any{"storage": size.String()}},
				"storageClassName": infraStorageClass,
			},
		},
	}}
	_, err = dvs.Create(ctx, dv, metav1.CreateOptions{})
	switch {
	case err == nil:
		t.logf("driver", "datavolume", "created DataVolume %s/%s (%s) for claim %s", t.ns, name, size.String(), key)
	case apierrors.IsAlreadyExists(err):
	default:
		b.refused("CreateVolume "+name, err)
		return "", fmt.Errorf("CreateVolume for claim %s: create DataVolume %s/%s: %w", key, t.ns, name, err)
	}
	return name, nil
}

// deleteVolume follows the driver's DeleteVolume (client.DeleteDataVolume):
// a DataVolume that is not there is success; one that lacks the tenant's
// infra labels is not this controller's and is refused.
func (b *kcsiBackend) deleteVolume(ctx context.Context, handle string) error {
	t := b.t
	dvs, err := b.dataVolumes(ctx)
	if err != nil {
		return fmt.Errorf("DeleteVolume %s: %w", handle, err)
	}
	dv, err := dvs.Get(ctx, handle, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return nil
	case err != nil:
		b.refused("DeleteVolume "+handle, err)
		return fmt.Errorf("DeleteVolume %s: get DataVolume: %w", handle, err)
	}
	for k, v := range t.diskLabels() {
		if dv.GetLabels()[k] != v {
			return fmt.Errorf("DeleteVolume %s: invalid volume name: DataVolume %s/%s lacks label %s=%s", handle, t.ns, handle, k, v)
		}
	}
	err = dvs.Delete(ctx, handle, metav1.DeleteOptions{})
	switch {
	case err == nil:
		t.logf("driver", "datavolume", "deleted DataVolume %s/%s (DeleteVolume returns; the disk goes with the management PVC)", t.ns, handle)
	case apierrors.IsNotFound(err):
	default:
		b.refused("DeleteVolume "+handle, err)
		return fmt.Errorf("DeleteVolume %s: delete DataVolume: %w", handle, err)
	}
	return nil
}

// publish hot-plugs the disk into the node's VM, as the driver's
// ControllerPublishVolume does: the DataVolume and the VM must exist (else
// NotFound); a VM that has the volume already is done; otherwise PUT
// virtualmachines/<vm>/addvolume (virt-api, through the aggregator) and
// wait, up to 2 minutes, for the VMI to report the volume Ready
// (client.AddVolumeToVM, client.EnsureVolumeAvailable).
func (b *kcsiBackend) publish(ctx context.Context, handle, nodeID string) error {
	t := b.t
	dyn, rc, err := b.clients(ctx)
	if err != nil {
		return err
	}
	_, vm, _ := cache.SplitMetaNamespaceKey(nodeID)
	if _, err := dyn.Resource(gvrDataVolume).Namespace(t.ns).Get(ctx, handle, metav1.GetOptions{}); err != nil {
		b.refused("ControllerPublishVolume "+handle, err)
		if apierrors.IsNotFound(err) {
			return status.Errorf(codes.NotFound, "volume %s not found", handle)
		}
		return err
	}
	obj, err := dyn.Resource(gvrVM).Namespace(t.ns).Get(ctx, vm, metav1.GetOptions{})
	if err != nil {
		b.refused("ControllerPublishVolume "+handle, err)
		if apierrors.IsNotFound(err) {
			return status.Errorf(codes.NotFound, "vm %s not found", vm)
		}
		return err
	}
	if !slices.Contains(hotplugged(obj), handle) {
		body, _ := json.Marshal(map[string]any{
			"name":         handle,
			"disk":         map[string]any{"name": handle, "disk": map[string]any{"bus": "scsi"}},
			"volumeSource": map[string]any{"dataVolume": map[string]any{"name": handle, "hotpluggable": true}},
		})
		err := hotplugRetry(ctx, func() error {
			return rc.Put().AbsPath("/apis", subresourcesAPI, "v1", "namespaces", t.ns, "virtualmachines", vm, "addvolume").
				Body(body).Do(ctx).Error()
		})
		if err != nil {
			b.refused("ControllerPublishVolume "+handle, err)
			return fmt.Errorf("add volume %s to VM %s/%s: %w", handle, t.ns, vm, err)
		}
	}
	return b.waitVolume(ctx, dyn, vm, handle, true)
}

// unpublish unplugs it (ControllerUnpublishVolume): from the VM's spec if
// it is there, else from the VMI if its status still lists it, else it is
// not attached; then waits for the VMI to stop listing it. A disk whose
// management PVC is gone is detached by definition (Cozystack's wrapper
// returns at once).
func (b *kcsiBackend) unpublish(ctx context.Context, handle, nodeID string) error {
	t := b.t
	dyn, rc, err := b.clients(ctx)
	if err != nil {
		return err
	}
	_, vm, _ := cache.SplitMetaNamespaceKey(nodeID)
	path := func(kind string) *rest.Request {
		return rc.Put().AbsPath("/apis", subresourcesAPI, "v1", "namespaces", t.ns, kind, vm, "removevolume").
			Body([]byte(fmt.Sprintf(`{"name":%q}`, handle)))
	}
	if obj, err := dyn.Resource(gvrVM).Namespace(t.ns).Get(ctx, vm, metav1.GetOptions{}); err == nil && slices.Contains(hotplugged(obj), handle) {
		if err := hotplugRetry(ctx, func() error { return path("virtualmachines").Do(ctx).Error() }); err != nil && !apierrors.IsNotFound(err) {
			b.refused("ControllerUnpublishVolume "+handle, err)
			return fmt.Errorf("remove volume %s from VM %s/%s: %w", handle, t.ns, vm, err)
		}
	} else if err != nil && !apierrors.IsNotFound(err) {
		b.refused("ControllerUnpublishVolume "+handle, err)
		return err
	} else if phase, err := b.vmiVolume(ctx, dyn, vm, handle); err != nil {
		return err
	} else if phase != "" {
		if err := hotplugRetry(ctx, func() error { return path("virtualmachineinstances").Do(ctx).Error() }); err != nil && !apierrors.IsNotFound(err) {
			b.refused("ControllerUnpublishVolume "+handle, err)
			return fmt.Errorf("remove volume %s from VMI %s/%s: %w", handle, t.ns, vm, err)
		}
	}
	return b.waitVolume(ctx, dyn, vm, handle, false)
}

// hotplugRetry makes a hotplug request as the driver does
// (ControllerService.addVolumeToVm / removeVolumeFromVm): retried on any
// error with a backoff of 1 s doubling, 5 attempts, capped at 30 s (a busy
// VM answers concurrent requests with conflicts); the last error is
// returned. An already-added volume (409 "already exists") is done.
func hotplugRetry(ctx context.Context, do func() error) error {
	var last error
	err := wait.ExponentialBackoffWithContext(ctx, wait.Backoff{Duration: time.Second, Factor: 2, Steps: 5, Cap: 30 * time.Second},
		func(context.Context) (bool, error) {
			last = do()
			if last == nil || apierrors.IsConflict(last) && strings.Contains(last.Error(), "already exists") {
				return true, nil
			}
			return false, nil
		})
	if err != nil && last != nil {
		return last
	}
	return err
}

// vmiVolume is the phase VMI vm's status gives volume handle, "" when it
// does not list it.
func (b *kcsiBackend) vmiVolume(ctx context.Context, dyn dynamic.Interface, vm, handle string) (string, error) {
	vmi, err := dyn.Resource(gvrVMI).Namespace(b.t.ns).Get(ctx, vm, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return "", nil
	}
	if err != nil {
		b.refused("read VMI "+vm, err)
		return "", err
	}
	statuses, _, _ := unstructured.NestedSlice(vmi.Object, "status", "volumeStatus")
	for _, raw := range statuses {
		if st, _ := raw.(map[string]any); st["name"] == handle {
			return fmt.Sprint(st["phase"]), nil
		}
	}
	return "", nil
}

// waitVolume polls the VMI every second, for up to 2 minutes, until it
// reports the volume Ready (present) or no longer lists it, as the
// driver's EnsureVolumeAvailable / EnsureVolumeRemoved do.
func (b *kcsiBackend) waitVolume(ctx context.Context, dyn dynamic.Interface, vm, handle string, present bool) error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		phase, err := b.vmiVolume(ctx, dyn, vm, handle)
		if err == nil && (present && phase == "Ready" || !present && phase == "") {
			return nil
		}
		if time.Now().After(deadline) {
			want := "Ready"
			if !present {
				want = "removed"
			}
			return fmt.Errorf("volume %s on VMI %s/%s: not %s within 2m (phase %q, last error: %v)", handle, b.t.ns, vm, want, phase, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// attachmentPod is the name of the Pod that attaches DataVolume dv to its VM.
func attachmentPod(dv string) string { return "hp-volume-" + dv }

func toAny(m map[string]string) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// startInfra runs the management side of the infra layer: the StorageClass
// and its provisioner, CDI, and the attachment Pods' kubelet.
func (s *sim) startInfra(ctx context.Context, factory dynamicinformer.DynamicSharedInformerFactory) {
	s.wg.Go(func() {
		if err := s.ensureInfraClass(ctx); err != nil {
			s.log.printf("infra", "", "error", "%v", err)
			return
		}
		kubeconfig, err := os.ReadFile(s.cfg.management)
		if err != nil {
			s.log.printf("infra", "", "error", "read the management kubeconfig for its provisioner: %v", err)
			return
		}
		d := &driver{s: s, name: infraDriverName, cs: s.mgmt, dyn: s.dyn, kubeconfig: kubeconfig,
			backend: &ledgerBackend{store: s.store, log: s.log, owner: s.infraOwner, layer: "management"},
			logf: func(component, action, format string, args ...any) {
				s.log.printf(component, "", action, format, args...)
			},
			prefix: "csi-management"}
		s.log.printf("infra", "", "started", "provisioner %s for StorageClass %s", infraDriverName, infraStorageClass)
		d.run(ctx)
	})
	c := &cdi{s: s}
	c.dvs = newLazyInformer(s, factory, gvrDataVolume, cache.ResourceEventHandlerFuncs{
		AddFunc:    c.enqueue,
		UpdateFunc: func(_, obj any) { c.enqueue(obj) },
	})
	s.wg.Go(func() { c.run(ctx) })
	s.wg.Go(func() { s.runAttachments(ctx) })
	s.startVirt(ctx, factory)
}

// infraOwner names the tenant of a management PVC: its namespace and the
// tenant's Cluster API label, or else the played Cluster API cluster whose
// management-side controller's labels it carries ("-" when none).
func (s *sim) infraOwner(pvc *corev1.PersistentVolumeClaim) (string, string) {
	r := pvc.Labels[prof.clusterLabel]
	if r == "" {
		r = s.capiDiskOwner(pvc.Namespace, pvc.Labels)
	}
	if r == "" || strings.ContainsAny(r, "./") {
		r = "-"
	}
	return pvc.Namespace, r
}

func (s *sim) ensureInfraClass(ctx context.Context) error {
	sc := &storagev1.StorageClass{
		ObjectMeta:        metav1.ObjectMeta{Name: infraStorageClass},
		Provisioner:       infraDriverName,
		ReclaimPolicy:     ptr.To(corev1.PersistentVolumeReclaimDelete),
		VolumeBindingMode: ptr.To(storagev1.VolumeBindingImmediate),
	}
	_, err := s.mgmt.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create StorageClass %s in the management cluster: %w", infraStorageClass, err)
	}
	return nil
}

// cdi makes each DataVolume's PVC, as CDI's DataVolume controller does: same
// name and namespace, the DataVolume's labels, owned by it (so garbage
// collection deletes the PVC once the DataVolume is gone).
type cdi struct {
	s   *sim
	dvs *lazyInformer
	q   workqueue.TypedRateLimitingInterface[string]
}

func (c *cdi) enqueue(obj any) {
	if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil && c.q != nil {
		c.q.Add(key)
	}
}

func (c *cdi) run(ctx context.Context) {
	c.q = newItemQueue("cdi")
	go c.dvs.run(ctx)
	drain(ctx, c.q, c.sync, func(key string, err error) {
		c.s.log.printf("cdi", "", "error", "DataVolume %s: %v (retrying)", key, err)
	})
}

func (c *cdi) sync(ctx context.Context, key string) error {
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	dv, ok, _ := c.dvs.get(ns, name)
	if !ok || dv.GetDeletionTimestamp() != nil || !c.s.inScope(ns) {
		return nil
	}
	sizeText, _, _ := unstructured.NestedString(dv.Object, "spec", "storage", "resources", "requests", "storage")
	size, err := resource.ParseQuantity(sizeText)
	if err != nil {
		return fmt.Errorf("spec.storage.resources.requests.storage %q: %v", sizeText, err)
	}
	class, _, _ := unstructured.NestedString(dv.Object, "spec", "storage", "storageClassName")
	if class == "" {
		class = infraStorageClass
	}
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: ns, Labels: dv.GetLabels(),
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: "cdi.kubevirt.io/v1beta1", Kind: "DataVolume", Name: name, UID: dv.GetUID(),
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true),
			}},
		},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: size}},
			StorageClassName: &class,
		},
	}
	_, err = c.s.mgmt.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{})
	switch {
	case err == nil:
		c.s.log.printf("cdi", ns+"/"+dv.GetLabels()[prof.clusterLabel], "pvc", "created PVC %s/%s for DataVolume %s", ns, name, name)
	case apierrors.IsAlreadyExists(err):
	default:
		return fmt.Errorf("create PVC: %w", err)
	}
	return nil
}

// runAttachments plays the kubelet of the attachment Pods: it confirms
// their deletion (as a kubelet does once the containers stopped), so a Pod
// deleted by garbage collection or by hand lets its PVC go.
func (s *sim) runAttachments(ctx context.Context) {
	f := informers.NewSharedInformerFactoryWithOptions(s.mgmt, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = attachmentLabel + "=" + attachmentValue }))
	inf := f.Core().V1().Pods()
	confirm := func(obj any) {
		pod, ok := tombstone(obj).(*corev1.Pod)
		if !ok || pod.DeletionTimestamp == nil || !s.inScope(pod.Namespace) {
			return
		}
		opts := metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0), Preconditions: &metav1.Preconditions{UID: &pod.UID}}
		err := s.mgmt.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, opts)
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) && ctx.Err() == nil {
			s.log.printf("infra", pod.Namespace+"/"+pod.Labels[attachmentTenantLabel], "error", "confirm deletion of Pod %s: %v", pod.Name, err)
		}
	}
	inf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    confirm,
		UpdateFunc: func(_, obj any) { confirm(obj) },
		DeleteFunc: func(obj any) {
			if pod, ok := tombstone(obj).(*corev1.Pod); ok && s.inScope(pod.Namespace) {
				s.log.printf("infra", pod.Namespace+"/"+pod.Labels[attachmentTenantLabel], "detached", "Pod %s gone: its disk is no longer held by the VM", pod.Name)
			}
		},
	})
	f.Start(ctx.Done())
	f.WaitForCacheSync(ctx.Done())
	<-ctx.Done()
	f.Shutdown()
}
