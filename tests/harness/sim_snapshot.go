package main

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
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
)

// The snapshot side of the driver: the snapshot controller and the CSI
// snapshotter for this driver, only when the tenant serves
// snapshot.storage.k8s.io (an absent API is skipped, not an error).
// Snapshots are recorded on storage like volumes (kind "snapshot"): a
// snapshot left behind is tenant data left behind.

var (
	gvrVolumeSnapshot        = schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshots"}
	gvrVolumeSnapshotContent = schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshotcontents"}
	gvrVolumeSnapshotClass   = schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshotclasses"}
)

const (
	vsBoundFinalizer    = "snapshot.storage.kubernetes.io/volumesnapshot-bound-protection"
	vsSourceFinalizer   = "snapshot.storage.kubernetes.io/volumesnapshot-as-source-protection"
	vscBoundFinalizer   = "snapshot.storage.kubernetes.io/volumesnapshotcontent-bound-protection"
	annDefaultSnapClass = "snapshot.storage.kubernetes.io/is-default-class"
)

type snapshotter struct {
	d                *driver
	vs, vsc, vsclass cache.GenericLister
	synced           func() bool
}

func (d *driver) runSnapshots(ctx context.Context) {
	// The snapshot CRDs may be installed while the driver runs.
	for {
		served, _ := resourceServed(d.cs.Discovery(), gvrVolumeSnapshot)
		if served {
			break
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(10 * time.Second):
		}
	}
	f := dynamicinformer.NewDynamicSharedInformerFactory(d.dyn, 30*time.Second)
	vsInf, vscInf, classInf := f.ForResource(gvrVolumeSnapshot), f.ForResource(gvrVolumeSnapshotContent), f.ForResource(gvrVolumeSnapshotClass)
	sn := &snapshotter{d: d, vs: vsInf.Lister(), vsc: vscInf.Lister(), vsclass: classInf.Lister()}
	enqueue := func(prefix string) func(any) {
		return func(obj any) {
			if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
				d.q.Add(prefix + key)
			}
		}
	}
	vsInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    enqueue("vs/"),
		UpdateFunc: func(_, obj any) { enqueue("vs/")(obj) },
	})
	// A content's changes (above all its going away) concern its snapshot.
	contentChanged := func(obj any) {
		u, ok := tombstone(obj).(*unstructured.Unstructured)
		if !ok {
			return
		}
		enqueue("vsc/")(u)
		ns, _, _ := unstructured.NestedString(u.Object, "spec", "volumeSnapshotRef", "namespace")
		name, _, _ := unstructured.NestedString(u.Object, "spec", "volumeSnapshotRef", "name")
		if name != "" {
			d.q.Add("vs/" + ns + "/" + name)
		}
	}
	vscInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    contentChanged,
		UpdateFunc: func(_, obj any) { contentChanged(obj) },
		DeleteFunc: contentChanged,
	})
	sn.synced = func() bool {
		return vsInf.Informer().HasSynced() && vscInf.Informer().HasSynced() && classInf.Informer().HasSynced()
	}
	// Set before the informers start: their first events queue work for it.
	d.setSnapshotter(sn)
	f.Start(ctx.Done())
	defer f.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), sn.synced) {
		return
	}
	d.t.logf("driver", "snapshots", "tenant serves snapshot.storage.k8s.io/v1: handling VolumeSnapshots")
	<-ctx.Done()
}

// syncSnapshot handles one VolumeSnapshot: take it (record + content) or,
// when it is being deleted, delete its content and let it go.
func (sn *snapshotter) syncSnapshot(ctx context.Context, key string) error {
	d := sn.d
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	obj, err := sn.vs.ByNamespace(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	vs := obj.(*unstructured.Unstructured)
	client := d.dyn.Resource(gvrVolumeSnapshot).Namespace(ns)
	contentName, _, _ := unstructured.NestedString(vs.Object, "status", "boundVolumeSnapshotContentName")
	if contentName == "" {
		contentName = "snapcontent-" + string(vs.GetUID())
	}

	if vs.GetDeletionTimestamp() != nil {
		if c, err := sn.vsc.Get(contentName); err == nil {
			content := c.(*unstructured.Unstructured)
			if policy, _, _ := unstructured.NestedString(content.Object, "spec", "deletionPolicy"); policy == "Delete" {
				if content.GetDeletionTimestamp() == nil {
					if err := d.dyn.Resource(gvrVolumeSnapshotContent).Delete(ctx, contentName, backgroundDeletion()); err != nil && !apierrors.IsNotFound(err) {
						return err
					}
					d.t.logf("driver", "snapshot", "deleting content %s of snapshot %s", contentName, key)
				}
				return nil // wait for the content to go; its deletion requeues us
			}
		}
		for _, f := range []string{vsBoundFinalizer, vsSourceFinalizer} {
			if _, err := removeFinalizerDynamic(ctx, client, name, vs.GetUID(), f); err != nil {
				return err
			}
		}
		return nil
	}

	if ready, _, _ := unstructured.NestedBool(vs.Object, "status", "readyToUse"); ready {
		return nil
	}
	claim, _, _ := unstructured.NestedString(vs.Object, "spec", "source", "persistentVolumeClaimName")
	if claim == "" {
		return nil // pre-provisioned content: not ours to take
	}
	class := sn.classFor(vs)
	if class == nil {
		return nil
	}
	pvc, err := d.pvcs.PersistentVolumeClaims(ns).Get(claim)
	if err != nil || pvc.Spec.VolumeName == "" {
		return nil // the claim's events do not requeue us; the resync does
	}
	pv, err := d.pvs.Get(pvc.Spec.VolumeName)
	if err != nil || pv.Spec.CSI == nil || pv.Spec.CSI.Driver != d.name {
		return nil
	}
	size := pv.Spec.Capacity[corev1.ResourceStorage]
	policy, _, _ := unstructured.NestedString(class.Object, "deletionPolicy")
	handle := fmt.Sprintf("%s.%s.snap-%s", d.t.ns, d.t.name, vs.GetUID())
	created, err := d.store.create(volumeRecord{
		Kind: "snapshot", Handle: handle, TenantNamespace: d.t.ns, Tenant: d.t.name,
		PVC: ns + "/" + claim, PVCUID: string(pvc.UID), PV: pv.Name, Capacity: size.String(),
		Snapshot: key, SourceHandle: pv.Spec.CSI.VolumeHandle,
	})
	if err != nil {
		return fmt.Errorf("CreateSnapshot %s: %w", handle, err)
	}
	if created {
		d.t.logf("storage", "created", "snapshot %s of volume %s", handle, pv.Spec.CSI.VolumeHandle)
	}
	now := time.Now()
	content := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1",
		"kind":       "VolumeSnapshotContent",
		"metadata":   map[string]any{"name": contentName, "finalizers": []any{vscBoundFinalizer}},
		"spec": map[string]any{
			"driver":                  d.name,
			"deletionPolicy":          policy,
			"volumeSnapshotClassName": class.GetName(),
			"source":                  map[string]any{"volumeHandle": pv.Spec.CSI.VolumeHandle},
			"volumeSnapshotRef": map[string]any{
				"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
				"namespace": ns, "name": name, "uid": string(vs.GetUID()),
			},
		},
	}}
	contents := d.dyn.Resource(gvrVolumeSnapshotContent)
	got, err := contents.Create(ctx, content, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		got, err = contents.Get(ctx, contentName, metav1.GetOptions{})
	}
	if err != nil {
		return fmt.Errorf("create VolumeSnapshotContent %s: %w", contentName, err)
	}
	got.Object["status"] = map[string]any{
		"snapshotHandle": handle, "readyToUse": true,
		"restoreSize": size.Value(), "creationTime": now.UnixNano(),
	}
	if _, err := contents.UpdateStatus(ctx, got, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("status of VolumeSnapshotContent %s: %w", contentName, err)
	}
	if !slices.Contains(vs.GetFinalizers(), vsBoundFinalizer) {
		patch := fmt.Appendf(nil, `{"metadata":{"finalizers":%s}}`, mustJSON(append(vs.GetFinalizers(), vsBoundFinalizer)))
		if _, err := client.Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			return err
		}
	}
	fresh, err := client.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	fresh.Object["status"] = map[string]any{
		"boundVolumeSnapshotContentName": contentName, "readyToUse": true,
		"restoreSize": size.String(), "creationTime": now.UTC().Format(time.RFC3339),
	}
	if _, err := client.UpdateStatus(ctx, fresh, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("status of VolumeSnapshot %s: %w", key, err)
	}
	d.t.logf("driver", "snapshot", "took %s of claim %s/%s: content=%s handle=%s policy=%s", key, ns, claim, contentName, handle, policy)
	return nil
}

// classFor returns the VolumeSnapshotClass of this driver that vs uses
// (named, or the default one), or nil.
func (sn *snapshotter) classFor(vs *unstructured.Unstructured) *unstructured.Unstructured {
	name, _, _ := unstructured.NestedString(vs.Object, "spec", "volumeSnapshotClassName")
	if name != "" {
		obj, err := sn.vsclass.Get(name)
		if err != nil {
			return nil
		}
		c := obj.(*unstructured.Unstructured)
		if drv, _, _ := unstructured.NestedString(c.Object, "driver"); drv != sn.d.name {
			return nil
		}
		return c
	}
	all, _ := sn.vsclass.List(labels.Everything())
	for _, obj := range all {
		c := obj.(*unstructured.Unstructured)
		drv, _, _ := unstructured.NestedString(c.Object, "driver")
		if drv == sn.d.name && c.GetAnnotations()[annDefaultSnapClass] == "true" {
			return c
		}
	}
	return nil
}

// syncContent handles one VolumeSnapshotContent of this driver: a deleted
// content with policy Delete frees its snapshot on storage; a content whose
// snapshot is gone is deleted (the snapshot controller's job).
func (sn *snapshotter) syncContent(ctx context.Context, name string) error {
	d := sn.d
	obj, err := sn.vsc.Get(name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	c := obj.(*unstructured.Unstructured)
	if drv, _, _ := unstructured.NestedString(c.Object, "spec", "driver"); drv != d.name {
		return nil
	}
	policy, _, _ := unstructured.NestedString(c.Object, "spec", "deletionPolicy")
	handle, _, _ := unstructured.NestedString(c.Object, "status", "snapshotHandle")
	contents := d.dyn.Resource(gvrVolumeSnapshotContent)
	if c.GetDeletionTimestamp() != nil {
		if policy == "Delete" && handle != "" {
			existed, err := d.store.remove(handle)
			if err != nil {
				return fmt.Errorf("DeleteSnapshot %s: %w", handle, err)
			}
			if existed {
				d.t.logf("storage", "deleted", "snapshot %s (content %s)", handle, name)
			}
		}
		_, err := removeFinalizerDynamic(ctx, contents, name, c.GetUID(), vscBoundFinalizer)
		return err
	}
	refNS, _, _ := unstructured.NestedString(c.Object, "spec", "volumeSnapshotRef", "namespace")
	refName, _, _ := unstructured.NestedString(c.Object, "spec", "volumeSnapshotRef", "name")
	refUID, _, _ := unstructured.NestedString(c.Object, "spec", "volumeSnapshotRef", "uid")
	if refName == "" || refUID == "" || policy != "Delete" {
		return nil
	}
	if vs, err := sn.vs.ByNamespace(refNS).Get(refName); err == nil && string(vs.(*unstructured.Unstructured).GetUID()) == refUID {
		return nil
	}
	if err := contents.Delete(ctx, name, backgroundDeletion()); err != nil && !apierrors.IsNotFound(err) {
		return err
	}
	d.t.logf("driver", "snapshot", "deleting content %s: its snapshot %s/%s is gone", name, refNS, refName)
	return nil
}

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}
