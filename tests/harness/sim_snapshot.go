package main

// The snapshot side of a driver, as Cozystack runs it: Kubernetes' own
// snapshot-controller and csi-snapshotter (external-snapshotter, built by
// tests/csi/build.sh) beside the CSI plugin, and the plugin's CreateSnapshot,
// DeleteSnapshot and ListSnapshots.
//
// Cozystack's R-kcsi-controller Deployment runs both beside the KubeVirt
// driver's controller, against the tenant API through the admin kubeconfig
// (packages/apps/kubernetes/templates/csi/deploy.yaml: `--timeout=1m
// --worker-threads=10` for csi-snapshotter, `--worker-threads=10` for
// snapshot-controller, image v8.3.0, no leader election). They run here
// once the cluster serves snapshot.storage.k8s.io (the tenant gets the CRDs
// from its own release; until then the real snapshot-controller exits and
// its container restarts). Everything Kubernetes decides (the contents,
// their finalizers, when DeleteSnapshot is called and retried) is theirs.
//
// The plugin follows the KubeVirt driver's controller
// (github.com/kubevirt/csi-driver pkg/service/controller.go,
// ControllerService.CreateSnapshot / DeleteSnapshot / ListSnapshots, and
// pkg/kubevirt/client.go CreateVolumeSnapshot / DeleteVolumeSnapshot): a
// tenant snapshot is a VolumeSnapshot of the DataVolume's PVC in the
// tenant's management namespace, named as the request (`snapshot-<tenant
// VolumeSnapshot UID>`), with the tenant's infra labels and no class; the
// driver waits up to 2 minutes for it to be ready after creating it. That
// VolumeSnapshot is taken by the management cluster's own storage, through
// the same two sidecars run against the management cluster and the
// management plugin (ledgerBackend): the snapshot on storage is a ledger
// file of kind "snapshot", layer "management". A driver without the infra
// layer (the Proxmox path) keeps its snapshots in the ledger itself.

import (
	"context"
	"fmt"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
)

var (
	gvrVolumeSnapshot      = schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshots"}
	gvrVolumeSnapshotClass = schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshotclasses"}
)

// infraSnapshotClass is the management cluster's default VolumeSnapshotClass
// for its storage: the KubeVirt driver's VolumeSnapshots name no class.
const infraSnapshotClass = "sim-infra-snapshots"

// infraSnapshotClassRetain is the management storage's Retain class, for a
// platform that keeps its tenants' snapshots: a tenant class names it by
// the KubeVirt driver's parameter below.
const infraSnapshotClassRetain = "sim-infra-snapshots-retain"

// infraSnapshotClassParameter is the tenant VolumeSnapshotClass parameter
// naming the management class (client.go InfraSnapshotClassNameParameter).
const infraSnapshotClassParameter = "infraSnapshotClassName"

// snapshotReadyWait is how long the KubeVirt driver waits for a snapshot it
// created to be ready (client.go, waitForVolumeSnapshotReady).
const snapshotReadyWait = 2 * time.Minute

func (p *csiPlugin) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	name, source := req.GetName(), req.GetSourceVolumeId()
	switch {
	case name == "":
		return nil, status.Error(codes.InvalidArgument, "name missing in request")
	case source == "":
		return nil, status.Error(codes.InvalidArgument, "source volume ID missing in request")
	}
	snap, err := p.backend.createSnapshot(ctx, name, source, req.GetParameters())
	if err != nil {
		p.logf("driver", "error", "CreateSnapshot %s of %s: %v", name, source, err)
		return nil, err
	}
	p.logf("driver", "snapshot", "CreateSnapshot %s of %s: id=%s ready=%t", name, source, snap.GetSnapshotId(), snap.GetReadyToUse())
	return &csi.CreateSnapshotResponse{Snapshot: snap}, nil
}

func (p *csiPlugin) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	id := req.GetSnapshotId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "snapshot ID missing in request")
	}
	if err := p.backend.deleteSnapshot(ctx, id); err != nil {
		p.logf("driver", "error", "DeleteSnapshot %s: %v", id, err)
		return nil, err
	}
	p.logf("driver", "snapshot", "DeleteSnapshot %s done", id)
	return &csi.DeleteSnapshotResponse{}, nil
}

// ListSnapshots serves the one query the snapshotter makes (by snapshot ID,
// for a pre-provisioned content); a list of them all is not served.
func (p *csiPlugin) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	id := req.GetSnapshotId()
	if id == "" {
		return nil, status.Error(codes.Unimplemented, "this plugin lists snapshots by snapshot ID only")
	}
	snap, err := p.backend.snapshot(ctx, id)
	if err != nil {
		return nil, err
	}
	if snap == nil || (req.GetSourceVolumeId() != "" && snap.GetSourceVolumeId() != req.GetSourceVolumeId()) {
		return &csi.ListSnapshotsResponse{}, nil
	}
	return &csi.ListSnapshotsResponse{Entries: []*csi.ListSnapshotsResponse_Entry{{Snapshot: snap}}}, nil
}

// snapshotSidecars are csi-snapshotter and snapshot-controller with the
// flags Cozystack passes, but the paths, the log level and the feature
// gate: v8.7.0 enables volume group snapshots by default, which v8.3.0
// (Cozystack's image) did not and whose CRDs no cluster here serves.
func snapshotSidecars(sock, kubeconfig string) []sidecarSpec {
	common := []string{"--kubeconfig=" + kubeconfig, "--v=5", "--worker-threads=10", "--feature-gates=CSIVolumeGroupSnapshot=false"}
	return []sidecarSpec{
		{name: "csi-snapshotter", args: append([]string{"--csi-address=" + sock, "--timeout=1m"}, common...)},
		{name: "snapshot-controller", args: common},
	}
}

// runSnapshotSidecars runs the snapshot side once the cluster serves
// snapshot.storage.k8s.io, until ctx ends. Discovery is read every 10 s
// until then, standing in for the real snapshot-controller's restarts.
func (d *driver) runSnapshotSidecars(ctx context.Context, sock, kubeconfig string) {
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
	if d.t == nil {
		if err := d.ensureSnapshotClass(ctx); err != nil {
			d.logf("driver", "error", "%v", err)
			return
		}
	}
	d.logf("driver", "snapshots", "the cluster serves snapshot.storage.k8s.io/v1: starting csi-snapshotter and snapshot-controller")
	runSidecars(ctx, d.s.cfg.sidecars, d.s.cfg.sidecarLogs, d.prefix, snapshotSidecars(sock, kubeconfig), d.logf)
}

// ensureSnapshotClass makes the management storage's VolumeSnapshotClasses,
// the default (Delete) and a Retain one, retrying until ctx ends (the CRDs
// may be served a moment before the API server accepts the objects).
func (d *driver) ensureSnapshotClass(ctx context.Context) error {
	for _, c := range []struct {
		name, policy string
		isDefault    bool
	}{{infraSnapshotClass, "Delete", true}, {infraSnapshotClassRetain, "Retain", false}} {
		meta := map[string]any{"name": c.name}
		if c.isDefault {
			meta["annotations"] = map[string]any{"snapshot.storage.kubernetes.io/is-default-class": "true"}
		}
		class := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion":     "snapshot.storage.k8s.io/v1",
			"kind":           "VolumeSnapshotClass",
			"metadata":       meta,
			"driver":         d.name,
			"deletionPolicy": c.policy,
		}}
		for {
			_, err := d.dyn.Resource(gvrVolumeSnapshotClass).Create(ctx, class, metav1.CreateOptions{})
			if err == nil || apierrors.IsAlreadyExists(err) {
				break
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("create VolumeSnapshotClass %s: %w", c.name, err)
			case <-time.After(time.Second):
			}
		}
	}
	return nil
}

// createSnapshot keeps a snapshot of a ledger volume as a ledger file named
// `<namespace>.<tenant>.<name>`; idempotent on name.
func (b *ledgerBackend) createSnapshot(_ context.Context, name, source string, _ map[string]string) (*csi.Snapshot, error) {
	src, ok := b.store.lookup(source)
	if !ok || src.Kind != "volume" {
		return nil, status.Errorf(codes.NotFound, "source volume %s not found", source)
	}
	handle := fmt.Sprintf("%s.%s.%s", src.TenantNamespace, src.Tenant, name)
	created, err := b.store.create(volumeRecord{
		Kind: "snapshot", Layer: b.layer, Handle: handle, TenantNamespace: src.TenantNamespace, Tenant: src.Tenant,
		PVC: src.PVC, PVCUID: src.PVCUID, PV: src.PV, StorageClass: src.StorageClass, Capacity: src.Capacity,
		SourceHandle: source,
	})
	if err != nil {
		return nil, fmt.Errorf("CreateSnapshot %s: %w", handle, err)
	}
	rec, ok := b.store.lookup(handle)
	switch {
	case !ok:
		return nil, status.Errorf(codes.Unavailable, "snapshot %s: record not readable yet", handle)
	case rec.SourceHandle != source:
		return nil, status.Errorf(codes.AlreadyExists, "snapshot %s exists of volume %s, not %s", handle, rec.SourceHandle, source)
	}
	if created {
		b.log.printf("storage", src.TenantNamespace+"/"+src.Tenant, "created", "snapshot %s of volume %s", handle, source)
	}
	return ledgerSnapshot(rec), nil
}

func ledgerSnapshot(rec volumeRecord) *csi.Snapshot {
	size, _ := resource.ParseQuantity(rec.Capacity)
	created, _ := time.Parse(time.RFC3339, rec.Created)
	return &csi.Snapshot{SnapshotId: rec.Handle, SourceVolumeId: rec.SourceHandle, SizeBytes: size.Value(),
		CreationTime: timestamppb.New(created), ReadyToUse: true}
}

// deleteSnapshot frees a ledger snapshot; one that is not there is success.
func (b *ledgerBackend) deleteSnapshot(ctx context.Context, id string) error {
	rec, ok := b.store.lookup(id)
	if ok && rec.Kind != "snapshot" {
		return status.Errorf(codes.InvalidArgument, "%s is a volume, not a snapshot", id)
	}
	if b.mayFree != nil {
		if err := b.mayFree(ctx, "DeleteSnapshot", id); err != nil {
			return err
		}
	}
	existed, err := b.store.remove(id)
	if err != nil {
		return fmt.Errorf("DeleteSnapshot %s: %w", id, err)
	}
	if existed {
		b.log.printf("storage", rec.TenantNamespace+"/"+rec.Tenant, "deleted", "snapshot %s (of volume %s)", id, rec.SourceHandle)
	}
	return nil
}

func (b *ledgerBackend) snapshot(_ context.Context, id string) (*csi.Snapshot, error) {
	rec, ok := b.store.lookup(id)
	if !ok || rec.Kind != "snapshot" {
		return nil, nil
	}
	return ledgerSnapshot(rec), nil
}

// volumeSnapshots is the management VolumeSnapshot API of the tenant's
// namespace, as R-kcsi.
func (b *kcsiBackend) volumeSnapshots(ctx context.Context) (dynamic.ResourceInterface, error) {
	dyn, _, err := b.clients(ctx)
	if err != nil {
		return nil, err
	}
	return dyn.Resource(gvrVolumeSnapshot).Namespace(b.t.ns), nil
}

// Errors of the management API are returned as they are (gRPC code
// Unknown, which csi-snapshotter takes as final), as the driver returns
// them; only a wait cut by the call's deadline is non-final.
//
// createSnapshot follows the driver's CreateSnapshot: an existing
// VolumeSnapshot of that name is returned as it is (or AlreadyExists if it
// is of another volume); otherwise the DataVolume must exist (NotFound),
// the VolumeSnapshot is created and waited for, up to 2 minutes, to be
// ready. Its class is the tenant class's `infraSnapshotClassName`
// parameter when set (controller.go CreateSnapshot reads
// req.Parameters[infraSnapshotClassName]; client.go CreateVolumeSnapshot
// names that class, else none, so the management default applies). The
// driver also checks that class against its storage mapping
// (getSnapshotClassNameFromVolumeClaimName); this does not.
func (b *kcsiBackend) createSnapshot(ctx context.Context, name, source string, params map[string]string) (*csi.Snapshot, error) {
	t := b.t
	vss, err := b.volumeSnapshots(ctx)
	if err != nil {
		return nil, fmt.Errorf("CreateSnapshot %s: %w", name, err)
	}
	vs, err := vss.Get(ctx, name, metav1.GetOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		b.refused("CreateSnapshot "+name, err)
		return nil, fmt.Errorf("CreateSnapshot %s: get VolumeSnapshot %s/%s: %w", name, t.ns, name, err)
	}
	if err == nil {
		if err := b.checkLabels("CreateSnapshot", vs); err != nil {
			return nil, err
		}
		return b.kcsiSnapshot(vs, source)
	}
	dvs, err := b.dataVolumes(ctx)
	if err != nil {
		return nil, fmt.Errorf("CreateSnapshot %s: %w", name, err)
	}
	if _, err := dvs.Get(ctx, source, metav1.GetOptions{}); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, status.Errorf(codes.NotFound, "source DataVolume %s/%s not found", t.ns, source)
		}
		b.refused("CreateSnapshot "+name, err)
		return nil, fmt.Errorf("CreateSnapshot %s: get DataVolume %s/%s: %w", name, t.ns, source, err)
	}
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1",
		"kind":       "VolumeSnapshot",
		"metadata":   map[string]any{"name": name, "namespace": t.ns, "labels": toAny(t.diskLabels())},
		"spec":       map[string]any{"source": map[string]any{"persistentVolumeClaimName": source}},
	}}
	if class := params[infraSnapshotClassParameter]; class != "" {
		if err := unstructured.SetNestedField(obj.Object, class, "spec", "volumeSnapshotClassName"); err != nil {
			return nil, err
		}
	}
	if _, err := vss.Create(ctx, obj, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		b.refused("CreateSnapshot "+name, err)
		return nil, fmt.Errorf("CreateSnapshot %s: create VolumeSnapshot %s/%s: %w", name, t.ns, name, err)
	}
	t.logf("driver", "snapshot", "created VolumeSnapshot %s/%s of DataVolume %s", t.ns, name, source)
	deadline := time.Now().Add(snapshotReadyWait)
	for {
		vs, err = vss.Get(ctx, name, metav1.GetOptions{})
		if err == nil {
			if ready, _, _ := unstructured.NestedBool(vs.Object, "status", "readyToUse"); ready {
				return b.kcsiSnapshot(vs, source)
			}
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("CreateSnapshot %s: VolumeSnapshot %s/%s not ready within %s (last error: %v)", name, t.ns, name, snapshotReadyWait, err)
		}
		select {
		case <-ctx.Done():
			return nil, status.FromContextError(ctx.Err()).Err()
		case <-time.After(time.Second):
		}
	}
}

// kcsiSnapshot is the CSI view of a management VolumeSnapshot
// (createCsiSnapshot); source, when set, must be the volume it is of.
func (b *kcsiBackend) kcsiSnapshot(vs *unstructured.Unstructured, source string) (*csi.Snapshot, error) {
	of, _, _ := unstructured.NestedString(vs.Object, "spec", "source", "persistentVolumeClaimName")
	if source != "" && of != source {
		return nil, status.Errorf(codes.AlreadyExists, "VolumeSnapshot %s/%s exists of volume %s, not %s", vs.GetNamespace(), vs.GetName(), of, source)
	}
	ready, _, _ := unstructured.NestedBool(vs.Object, "status", "readyToUse")
	sizeText, _, _ := unstructured.NestedString(vs.Object, "status", "restoreSize")
	size, _ := resource.ParseQuantity(sizeText)
	return &csi.Snapshot{SnapshotId: vs.GetName(), SourceVolumeId: of, SizeBytes: size.Value(),
		CreationTime: timestamppb.New(vs.GetCreationTimestamp().Time), ReadyToUse: ready}, nil
}

// infraSnapshot gets the management VolumeSnapshot `id`: nil if it is not
// there, an error if it lacks the tenant's infra labels (not this
// controller's: client.go's ErrInvalidSnapshot).
func (b *kcsiBackend) infraSnapshot(ctx context.Context, what, id string) (*unstructured.Unstructured, dynamic.ResourceInterface, error) {
	vss, err := b.volumeSnapshots(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("%s %s: %w", what, id, err)
	}
	vs, err := vss.Get(ctx, id, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return nil, vss, nil
	case err != nil:
		b.refused(what+" "+id, err)
		return nil, nil, fmt.Errorf("%s %s: get VolumeSnapshot: %w", what, id, err)
	}
	if err := b.checkLabels(what, vs); err != nil {
		return nil, nil, err
	}
	return vs, vss, nil
}

// checkLabels refuses a management VolumeSnapshot without the tenant's
// infra labels: not this controller's (client.go's ErrInvalidSnapshot, a
// plain error, so the sidecar retries).
func (b *kcsiBackend) checkLabels(what string, vs *unstructured.Unstructured) error {
	for k, v := range b.t.diskLabels() {
		if vs.GetLabels()[k] != v {
			return fmt.Errorf("%s %s: invalid snapshot: VolumeSnapshot %s/%s lacks label %s=%s", what, vs.GetName(), b.t.ns, vs.GetName(), k, v)
		}
	}
	return nil
}

// deleteSnapshot follows the driver's DeleteSnapshot: a VolumeSnapshot that
// is not there is success; it is deleted and not waited for (the management
// storage frees the snapshot behind it).
func (b *kcsiBackend) deleteSnapshot(ctx context.Context, id string) error {
	vs, vss, err := b.infraSnapshot(ctx, "DeleteSnapshot", id)
	if err != nil || vs == nil {
		return err
	}
	err = vss.Delete(ctx, id, metav1.DeleteOptions{})
	switch {
	case err == nil:
		b.t.logf("driver", "snapshot", "deleted VolumeSnapshot %s/%s (DeleteSnapshot returns; the management storage frees it)", b.t.ns, id)
	case apierrors.IsNotFound(err):
	default:
		b.refused("DeleteSnapshot "+id, err)
		return fmt.Errorf("DeleteSnapshot %s: delete VolumeSnapshot: %w", id, err)
	}
	return nil
}

func (b *kcsiBackend) snapshot(ctx context.Context, id string) (*csi.Snapshot, error) {
	vs, _, err := b.infraSnapshot(ctx, "ListSnapshots", id)
	if err != nil || vs == nil {
		return nil, err
	}
	return b.kcsiSnapshot(vs, "")
}
