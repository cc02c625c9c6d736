package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/ptr"
)

// driver is one provisioner: the CSI controller plugin (sim_csi.go) served
// on a unix socket and Kubernetes' external-provisioner running against
// its cluster (a tenant's, or the management cluster's own storage), plus
// the snapshot side (sim_snapshot.go) once that cluster serves it. It exists only while
// the driver is installed; when it is stopped, nothing frees the tenant's
// volumes, which is exactly the incident this project prevents.
type driver struct {
	s    *sim
	t    *tenant // nil for the management cluster's own provisioner
	name string
	cs   kubernetes.Interface
	dyn  dynamic.Interface
	// kubeconfig is the sidecars' view of the cluster: a tenant's admin
	// kubeconfig (the Secret's content), or the management's file's; it is
	// written, 0600, into the run directory the sidecars get.
	kubeconfig []byte
	// backend holds the disks and their snapshots.
	backend volumeBackend
	// logf logs for this provisioner (the tenant's column, or "-").
	logf func(component, action, format string, args ...any)
	// prefix names its sidecars' log files.
	prefix string

	pvcByUID cache.Indexer
}

// volumeBackend is where a provisioner's disks live.
type volumeBackend interface {
	// createVolume is CreateVolume `name` (pvc-<uid>) for claim pvc: it
	// makes the disk, idempotently, and returns its volume ID.
	createVolume(ctx context.Context, name string, pvc *corev1.PersistentVolumeClaim, size resource.Quantity) (string, error)
	// deleteVolume is DeleteVolume: nil once the disk is freed or was
	// never there.
	deleteVolume(ctx context.Context, handle string) error
	// publish attaches the disk to the node (ControllerPublishVolume);
	// unpublish detaches it, nil if it was not attached.
	publish(ctx context.Context, handle, nodeID string) error
	unpublish(ctx context.Context, handle, nodeID string) error
	// createSnapshot is CreateSnapshot `name` of volume source with the
	// class's parameters, idempotent on name; deleteSnapshot is DeleteSnapshot, nil once the snapshot is
	// freed or was never there; snapshot is the snapshot `id`, nil if it is
	// not there.
	createSnapshot(ctx context.Context, name, source string, params map[string]string) (*csi.Snapshot, error)
	deleteSnapshot(ctx context.Context, id string) error
	snapshot(ctx context.Context, id string) (*csi.Snapshot, error)
}

// newDriver is a tenant's CSI driver: with an infra layer in the profile
// its disks are DataVolumes in the management cluster (sim_infra.go), else
// files in the ledger.
func newDriver(t *tenant, cs kubernetes.Interface, dyn dynamic.Interface, kubeconfig []byte) *driver {
	var b volumeBackend = &ledgerBackend{store: t.s.store, log: t.s.log, owner: t.owner, mayFree: t.mayFree}
	switch {
	case t.capi && t.managementCSI() != nil:
		// The management-side controller (kubevirt-csi-driver's split
		// deployment): DataVolumes, freed as its own ServiceAccount.
		b = &kcsiBackend{t: t}
	case t.capi:
		// The in-tenant controller: its disks in the ledger, freed with
		// its own (the tenant's) credentials, no management identity.
		b = &ledgerBackend{store: t.s.store, log: t.s.log, owner: t.owner}
	case prof.infra != nil:
		b = &kcsiBackend{t: t}
	}
	return &driver{s: t.s, t: t, name: t.s.cfg.driver, cs: cs, dyn: dyn, kubeconfig: kubeconfig, backend: b,
		logf: t.logf, prefix: "csi-" + t.ns + "." + t.name}
}

// ledgerBackend keeps each disk as a file in the storage ledger.
type ledgerBackend struct {
	store *storage
	log   *simLog
	// owner names the tenant a claim's disk belongs to.
	owner func(pvc *corev1.PersistentVolumeClaim) (ns, tenant string)
	// mayFree, when set, must allow each DeleteVolume and DeleteSnapshot.
	mayFree func(ctx context.Context, what, id string) error
	// layer is recorded with each disk ("" for the tenant's own).
	layer string
}

func (b *ledgerBackend) createVolume(_ context.Context, name string, pvc *corev1.PersistentVolumeClaim, size resource.Quantity) (string, error) {
	ns, r := b.owner(pvc)
	handle := fmt.Sprintf("%s.%s.%s", ns, r, pvc.UID)
	created, err := b.store.create(volumeRecord{
		Kind: "volume", Layer: b.layer, Handle: handle, TenantNamespace: ns, Tenant: r,
		PVC: pvc.Namespace + "/" + pvc.Name, PVCUID: string(pvc.UID), PV: name,
		StorageClass: ptr.Deref(pvc.Spec.StorageClassName, ""), Capacity: size.String(),
	})
	if err != nil {
		return "", fmt.Errorf("CreateVolume %s: %w", handle, err)
	}
	if created {
		b.log.printf("storage", ns+"/"+r, "created", "volume %s (%s) for claim %s/%s", handle, size.String(), pvc.Namespace, pvc.Name)
	}
	return handle, nil
}

func (b *ledgerBackend) deleteVolume(ctx context.Context, handle string) error {
	if b.mayFree != nil {
		if err := b.mayFree(ctx, "DeleteVolume", handle); err != nil {
			return err
		}
	}
	rec, _ := b.store.lookup(handle)
	existed, err := b.store.remove(handle)
	if err != nil {
		return fmt.Errorf("DeleteVolume %s: %w", handle, err)
	}
	if existed {
		ns, r := "-", "-"
		if parts := strings.SplitN(handle, ".", 3); len(parts) == 3 {
			ns, r = parts[0], parts[1]
		}
		b.log.printf("storage", ns+"/"+r, "deleted", "volume %s (pv %s, claim %s)", handle, orDash(rec.PV), orDash(rec.PVC))
	}
	return nil
}

// publish and unpublish: a ledger disk is reachable from any node (the
// Proxmox driver attaches it to the node's VM; nothing here depends on it).
func (b *ledgerBackend) publish(context.Context, string, string) error   { return nil }
func (b *ledgerBackend) unpublish(context.Context, string, string) error { return nil }

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// drain runs sync for each key of q until ctx ends, retrying a failed key
// on the queue's backoff after reporting it with failed.
func drain[K comparable](ctx context.Context, q workqueue.TypedRateLimitingInterface[K], sync func(context.Context, K) error, failed func(K, error)) {
	defer q.ShutDown()
	go func() {
		<-ctx.Done()
		q.ShutDown()
	}()
	for {
		key, quit := q.Get()
		if quit {
			return
		}
		if err := sync(ctx, key); err != nil && ctx.Err() == nil {
			failed(key, err)
			q.AddRateLimited(key)
		} else {
			q.Forget(key)
		}
		q.Done(key)
	}
}

func newItemQueue(name string) workqueue.TypedRateLimitingInterface[string] {
	return workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](500*time.Millisecond, 10*time.Second),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: name})
}

// run serves the plugin and runs the external-provisioner (and attacher)
// against it until ctx ends, and the snapshot side once the cluster serves
// it.
func (d *driver) run(ctx context.Context) {
	f := informers.NewSharedInformerFactory(d.cs, 30*time.Second)
	pvcInf := f.Core().V1().PersistentVolumeClaims()
	if err := pvcInf.Informer().AddIndexers(cache.Indexers{byUID: func(obj any) ([]string, error) {
		return []string{string(obj.(*corev1.PersistentVolumeClaim).UID)}, nil
	}}); err != nil {
		d.logf("driver", "error", "index claims: %v", err)
		return
	}
	d.pvcByUID = pvcInf.Informer().GetIndexer()
	f.Start(ctx.Done())
	defer f.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), pvcInf.Informer().HasSynced) {
		return
	}

	dir, err := os.MkdirTemp(d.s.csiRun, "d")
	if err != nil {
		d.logf("driver", "error", "socket directory: %v", err)
		return
	}
	defer os.RemoveAll(dir)
	// As the Pod mounts the Secret's content (never logged).
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(kubeconfig, d.kubeconfig, 0o600); err != nil {
		d.logf("driver", "error", "write the sidecars' kubeconfig: %v", err)
		return
	}
	plugin := &csiPlugin{name: d.name, backend: d.backend, attach: d.t != nil, claim: d.claimByUID, logf: d.logf, due: map[string]time.Time{}}
	if d.t != nil {
		plugin.slow = d.t.freeAfter
	}
	sock := filepath.Join(dir, "csi.sock")
	srv, err := serveCSI(sock, plugin)
	if err != nil {
		d.logf("driver", "error", "serve the CSI plugin: %v", err)
		return
	}
	defer srv.stop()
	var sidecars sync.WaitGroup
	sidecars.Go(func() {
		runSidecars(ctx, d.s.cfg.sidecars, d.s.cfg.sidecarLogs, d.prefix, cozystackSidecars(sock, kubeconfig, plugin.attach), d.logf)
	})
	sidecars.Go(func() { d.runSnapshotSidecars(ctx, sock, kubeconfig) })
	// The sidecars stop before the plugin they talk to.
	defer sidecars.Wait()

	if d.t != nil && (!d.t.capi || d.t.managementCSI() != nil) {
		// The controller gets its ServiceAccount token when it starts, as a
		// Pod gets its projected token.
		if ok, why := d.t.kcsiAllowed(ctx); !ok {
			d.t.kcsi.noteRefusal(why)
			d.logf("driver", "identity-missing", "at start: %s", why)
		}
	}
	<-ctx.Done()
}

const byUID = "uid"

// claimByUID is the claim with that UID, from the cache.
func (d *driver) claimByUID(uid string) *corev1.PersistentVolumeClaim {
	objs, err := d.pvcByUID.ByIndex(byUID, uid)
	if err != nil || len(objs) == 0 {
		return nil
	}
	return objs[0].(*corev1.PersistentVolumeClaim)
}
