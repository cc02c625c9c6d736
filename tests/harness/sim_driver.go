package main

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
)

const (
	annStorageProvisioner     = "volume.kubernetes.io/storage-provisioner"
	annBetaStorageProvisioner = "volume.beta.kubernetes.io/storage-provisioner"
	annSelectedNode           = "volume.kubernetes.io/selected-node"
	annProvisionedBy          = "pv.kubernetes.io/provisioned-by"
	provisionerFinalizer      = "external-provisioner.volume.kubernetes.io/finalizer"
)

// driver is the simulated CSI controller (external-provisioner plus the
// plugin behind it) for one tenant. It exists only while the driver is
// installed; when it is stopped, nothing frees the tenant's volumes, which
// is exactly the incident this project prevents.
type driver struct {
	t    *tenant // nil for the management cluster's own provisioner
	name string
	cs   kubernetes.Interface
	dyn  dynamic.Interface
	// backend holds the disks: CreateVolume and DeleteVolume.
	backend volumeBackend
	// scope, when set, limits it to claims in these namespaces.
	scope func(ns string) bool
	// store is the ledger, for snapshots (tenant drivers only).
	store *storage
	// logf logs for this provisioner (the tenant's column, or "-").
	logf func(component, action, format string, args ...any)
	q    workqueue.TypedRateLimitingInterface[string]

	pvcs corelisters.PersistentVolumeClaimLister
	pvs  corelisters.PersistentVolumeLister
	scs  storagelisters.StorageClassLister

	// snap is set once the tenant is found to serve the snapshot API.
	snap atomic.Pointer[snapshotter]
	// deleted holds the PVs this driver deleted, so that a second delete
	// from a stale cache (which the API server also answers with success)
	// is not logged twice. Owned by the worker goroutine.
	deleted map[types.UID]bool
	// releasedAt is when this driver first saw each PV ready to be freed,
	// for a slow driver (annFreeAfter). Owned by the worker goroutine.
	releasedAt map[types.UID]time.Time
}

func (d *driver) setSnapshotter(sn *snapshotter) { d.snap.Store(sn) }

// volumeBackend is where a provisioner's disks live.
type volumeBackend interface {
	// createVolume is CreateVolume for claim key (PV pvName to be): it
	// makes the disk, idempotently, and returns its volumeHandle.
	createVolume(ctx context.Context, key string, pvc *corev1.PersistentVolumeClaim, pvName, class string, size resource.Quantity) (string, error)
	// deleteVolume is DeleteVolume for pv: nil once the disk is freed or
	// was never there.
	deleteVolume(ctx context.Context, pv *corev1.PersistentVolume) error
}

// newDriver is a tenant's CSI driver: with an infra layer in the profile
// its disks are DataVolumes in the management cluster (sim_infra.go), else
// files in the ledger.
func newDriver(t *tenant, cs kubernetes.Interface, dyn dynamic.Interface) *driver {
	var b volumeBackend = &ledgerBackend{store: t.s.store, log: t.s.log, owner: t.owner, mayFree: t.mayFree}
	if prof.infra != nil {
		b = &kcsiBackend{t: t}
	}
	return &driver{t: t, name: t.s.cfg.driver, cs: cs, dyn: dyn, backend: b, store: t.s.store, logf: t.logf,
		deleted: map[types.UID]bool{}, releasedAt: map[types.UID]time.Time{}}
}

// ledgerBackend keeps each disk as a file in the storage ledger.
type ledgerBackend struct {
	store *storage
	log   *simLog
	// owner names the tenant a claim's disk belongs to.
	owner func(pvc *corev1.PersistentVolumeClaim) (ns, tenant string)
	// mayFree, when set, must allow each DeleteVolume.
	mayFree func(ctx context.Context, handle, pv string) error
	// layer is recorded with each disk ("" for the tenant's own).
	layer string
}

func (b *ledgerBackend) createVolume(_ context.Context, key string, pvc *corev1.PersistentVolumeClaim, pvName, class string, size resource.Quantity) (string, error) {
	ns, r := b.owner(pvc)
	handle := fmt.Sprintf("%s.%s.%s", ns, r, pvc.UID)
	created, err := b.store.create(volumeRecord{
		Kind: "volume", Layer: b.layer, Handle: handle, TenantNamespace: ns, Tenant: r,
		PVC: key, PVCUID: string(pvc.UID), PV: pvName, StorageClass: class, Capacity: size.String(),
	})
	if err != nil {
		return "", fmt.Errorf("CreateVolume %s: %w", handle, err)
	}
	if created {
		b.log.printf("storage", ns+"/"+r, "created", "volume %s (%s) for claim %s", handle, size.String(), key)
	}
	return handle, nil
}

func (b *ledgerBackend) deleteVolume(ctx context.Context, pv *corev1.PersistentVolume) error {
	handle := pv.Spec.CSI.VolumeHandle
	if b.mayFree != nil {
		if err := b.mayFree(ctx, handle, pv.Name); err != nil {
			return err
		}
	}
	existed, err := b.store.remove(handle)
	if err != nil {
		return fmt.Errorf("DeleteVolume %s: %w", handle, err)
	}
	if existed {
		ns, r := "-", "-"
		if parts := strings.SplitN(handle, ".", 3); len(parts) == 3 {
			ns, r = parts[0], parts[1]
		}
		b.log.printf("storage", ns+"/"+r, "deleted", "volume %s (pv %s, claim %s)", handle, pv.Name, claimOf(pv))
	}
	return nil
}

func newItemQueue(name string) workqueue.TypedRateLimitingInterface[string] {
	return workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](500*time.Millisecond, 10*time.Second),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: name})
}

func (d *driver) run(ctx context.Context) {
	d.q = newItemQueue("driver")
	defer d.q.ShutDown()
	// The resync is a safety net only: every decision is also triggered by
	// the event that makes it possible.
	f := informers.NewSharedInformerFactory(d.cs, 30*time.Second)
	pvcInf := f.Core().V1().PersistentVolumeClaims()
	pvInf := f.Core().V1().PersistentVolumes()
	scInf := f.Storage().V1().StorageClasses()
	d.pvcs, d.pvs, d.scs = pvcInf.Lister(), pvInf.Lister(), scInf.Lister()

	enqueue := func(prefix string) func(any) {
		return func(obj any) {
			if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
				d.q.Add(prefix + key)
			}
		}
	}
	pvcInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    enqueue("pvc/"),
		UpdateFunc: func(_, obj any) { enqueue("pvc/")(obj) },
	})
	pvInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    enqueue("pv/"),
		UpdateFunc: func(_, obj any) { enqueue("pv/")(obj) },
	})
	// A claim may be created before its StorageClass.
	scInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			sc := obj.(*storagev1.StorageClass)
			claims, _ := d.pvcs.List(labels.Everything())
			for _, c := range claims {
				if c.Spec.StorageClassName != nil && *c.Spec.StorageClassName == sc.Name {
					enqueue("pvc/")(c)
				}
			}
		},
	})
	f.Start(ctx.Done())
	defer f.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), pvcInf.Informer().HasSynced, pvInf.Informer().HasSynced, scInf.Informer().HasSynced) {
		return
	}
	if d.t != nil {
		// The controller gets its ServiceAccount token when it starts, as a
		// Pod gets its projected token; it is checked again before each
		// DeleteVolume.
		if ok, why := d.t.kcsiAllowed(ctx); !ok {
			d.t.kcsi.logged = why
			d.logf("driver", "identity-missing", "at start: %s", why)
		}
		go d.runSnapshots(ctx)
	}
	go func() {
		<-ctx.Done()
		d.q.ShutDown()
	}()
	for d.processNext(ctx) {
	}
}

func (d *driver) processNext(ctx context.Context) bool {
	key, quit := d.q.Get()
	if quit {
		return false
	}
	defer d.q.Done(key)
	kind, rest, _ := strings.Cut(key, "/")
	var err error
	switch kind {
	case "pvc":
		err = d.syncClaim(ctx, rest)
	case "pv":
		err = d.syncVolume(ctx, rest)
	case "vs", "vsc":
		sn := d.snap.Load()
		if sn == nil || !sn.synced() {
			// Decide on complete caches only.
			d.q.AddAfter(key, time.Second)
			break
		}
		if kind == "vs" {
			err = sn.syncSnapshot(ctx, rest)
		} else {
			err = sn.syncContent(ctx, rest)
		}
	}
	if err != nil && ctx.Err() == nil {
		d.logf("driver", "error", "%s: %v (retrying)", key, err)
		d.q.AddRateLimited(key)
		return true
	}
	d.q.Forget(key)
	return true
}

// syncClaim is CreateVolume: it provisions a PV for an unbound claim of a
// StorageClass of this driver, as external-provisioner does. The PV
// controller then binds the two.
func (d *driver) syncClaim(ctx context.Context, key string) error {
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	pvc, err := d.pvcs.PersistentVolumeClaims(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if pvc.Spec.VolumeName != "" || pvc.Status.Phase != corev1.ClaimPending || pvc.DeletionTimestamp != nil {
		return nil
	}
	if d.scope != nil && !d.scope(ns) {
		return nil
	}
	if pvc.Spec.StorageClassName == nil || *pvc.Spec.StorageClassName == "" {
		return nil
	}
	sc, err := d.scs.Get(*pvc.Spec.StorageClassName)
	if err != nil || sc.Provisioner != d.name {
		return nil
	}
	// The PV controller hands the claim to a provisioner by annotating it.
	if p := pvc.Annotations[annStorageProvisioner]; p != d.name && pvc.Annotations[annBetaStorageProvisioner] != d.name {
		return nil
	}
	if sc.VolumeBindingMode != nil && *sc.VolumeBindingMode == storagev1.VolumeBindingWaitForFirstConsumer &&
		pvc.Annotations[annSelectedNode] == "" {
		return nil
	}
	pvName := "pvc-" + string(pvc.UID)
	if pv, err := d.pvs.Get(pvName); err == nil && pv.Spec.ClaimRef != nil && pv.Spec.ClaimRef.UID == pvc.UID {
		return nil // provisioned; the PV controller binds it
	}
	size, ok := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	if !ok || size.IsZero() {
		return fmt.Errorf("claim %s requests no storage", key)
	}
	// CreateVolume on the storage first, then the PV that names it.
	handle, err := d.backend.createVolume(ctx, key, pvc, pvName, sc.Name, size)
	if err != nil {
		return err
	}

	policy := corev1.PersistentVolumeReclaimDelete
	if sc.ReclaimPolicy != nil {
		policy = *sc.ReclaimPolicy
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{
			Name:        pvName,
			Annotations: map[string]string{annProvisionedBy: d.name},
			Finalizers:  []string{provisionerFinalizer},
		},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:    corev1.ResourceList{corev1.ResourceStorage: size},
			AccessModes: pvc.Spec.AccessModes,
			PersistentVolumeSource: corev1.PersistentVolumeSource{
				CSI: &corev1.CSIPersistentVolumeSource{Driver: d.name, VolumeHandle: handle, FSType: "ext4"},
			},
			ClaimRef: &corev1.ObjectReference{
				Kind: "PersistentVolumeClaim", APIVersion: "v1",
				Namespace: pvc.Namespace, Name: pvc.Name, UID: pvc.UID, ResourceVersion: pvc.ResourceVersion,
			},
			PersistentVolumeReclaimPolicy: policy,
			StorageClassName:              sc.Name,
			MountOptions:                  sc.MountOptions,
			VolumeMode:                    pvc.Spec.VolumeMode,
		},
	}
	if _, err := d.cs.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		if apierrors.IsAlreadyExists(err) {
			return nil
		}
		return fmt.Errorf("create PV %s: %w", pvName, err)
	}
	d.logf("driver", "provisioned", "pv=%s claim=%s handle=%s capacity=%s reclaim=%s", pvName, key, handle, size.String(), policy)
	return nil
}

// syncVolume is DeleteVolume: a Released PV of this driver with reclaim
// policy Delete has its volume freed on storage first, then the PV goes.
func (d *driver) syncVolume(ctx context.Context, name string) error {
	pv, err := d.pvs.Get(name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != d.name || pv.Annotations[annProvisionedBy] != d.name {
		return nil
	}
	if d.scope != nil && pv.Spec.ClaimRef != nil && !d.scope(pv.Spec.ClaimRef.Namespace) {
		return nil
	}
	handle := pv.Spec.CSI.VolumeHandle
	switch pv.Spec.PersistentVolumeReclaimPolicy {
	case corev1.PersistentVolumeReclaimDelete:
		// A PV deleted directly (not Released) is freed too once nothing is
		// bound to it: the provisioner's finalizer exists for that case.
		released := pv.Status.Phase == corev1.VolumeReleased ||
			(pv.DeletionTimestamp != nil && pv.Status.Phase != corev1.VolumeBound)
		if !released {
			return nil
		}
		if wait := d.slowness(pv); wait > 0 {
			d.q.AddAfter("pv/"+pv.Name, wait)
			return nil
		}
		if err := d.backend.deleteVolume(ctx, pv); err != nil {
			return err
		}
		if _, err := d.dropFinalizer(ctx, pv); err != nil {
			return err
		}
		if pv.DeletionTimestamp == nil {
			pre := metav1.Preconditions{UID: &pv.UID}
			opts := backgroundDeletion()
			opts.Preconditions = &pre
			err := d.cs.CoreV1().PersistentVolumes().Delete(ctx, pv.Name, opts)
			switch {
			case err == nil && !d.deleted[pv.UID]:
				d.deleted[pv.UID] = true
				d.logf("driver", "deleted", "pv=%s handle=%s (DeleteVolume done)", pv.Name, handle)
			case err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err):
				return fmt.Errorf("delete PV %s: %w", pv.Name, err)
			}
		}
	case corev1.PersistentVolumeReclaimRetain:
		// Retained volumes stay on storage; only our finalizer goes, so the
		// PV object itself can be deleted.
		if pv.DeletionTimestamp != nil && slices.Contains(pv.Finalizers, provisionerFinalizer) {
			if removed, err := d.dropFinalizer(ctx, pv); err != nil || !removed {
				return err
			}
			d.logf("driver", "retained", "pv=%s deleted; volume %s stays on storage (reclaim policy Retain)", pv.Name, handle)
		}
	}
	return nil
}

// slowness is how much longer a slow driver (annFreeAfter on R-csi) takes
// before it frees pv: the delay counts from when it first saw pv released.
func (d *driver) slowness(pv *corev1.PersistentVolume) time.Duration {
	if d.t == nil {
		return 0
	}
	delay := d.t.freeAfter()
	if delay <= 0 {
		return 0
	}
	first, ok := d.releasedAt[pv.UID]
	if !ok {
		first = time.Now()
		d.releasedAt[pv.UID] = first
		d.logf("driver", "slow", "pv=%s handle=%s freed no sooner than %s from now (%s)", pv.Name, pv.Spec.CSI.VolumeHandle, delay, annFreeAfter)
	}
	return time.Until(first.Add(delay))
}

// dropFinalizer removes the provisioner's finalizer from pv (as cached; a
// stale copy makes the guarded patch fail and the item is retried).
func (d *driver) dropFinalizer(ctx context.Context, pv *corev1.PersistentVolume) (bool, error) {
	patch, ok := withoutFinalizer(pv.Finalizers, provisionerFinalizer)
	if !ok {
		return false, nil
	}
	_, err := d.cs.CoreV1().PersistentVolumes().Patch(ctx, pv.Name, types.JSONPatchType, patch, metav1.PatchOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("remove finalizer from PV %s: %w", pv.Name, err)
	}
	return true, nil
}

func claimOf(pv *corev1.PersistentVolume) string {
	if pv.Spec.ClaimRef == nil {
		return "-"
	}
	return pv.Spec.ClaimRef.Namespace + "/" + pv.Spec.ClaimRef.Name
}
