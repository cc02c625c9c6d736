package main

// Attach and detach on a tenant's node, the kubelet's part. The tenant's
// controller manager runs Kubernetes' attach/detach controller: for each
// volume a Pod scheduled to the node uses, it creates a VolumeAttachment,
// which the external-attacher beside the driver's controller (sim_csi.go)
// attaches through ControllerPublishVolume; once no Pod uses it and the
// kubelet no longer reports it in use, the controller deletes the
// VolumeAttachment and the attacher detaches it (ControllerUnpublishVolume).
// The external-provisioner refuses to delete a volume while a
// VolumeAttachment names its PV. A node whose kubelet stopped goes NotReady
// and Kubernetes' own timers apply: the controller detaches a volume still
// reported in use only after its maxWaitForUnmountDuration (6 minutes) on an
// unhealthy node.
//
// The kubelet's side, as the real one does it: the Node is annotated
// volumes.kubernetes.io/controller-managed-attach-detach, so the controller
// attaches; CSINode names the driver's node ID (`<namespace>/<vm>`, the
// KubeVirt driver's form); a Pod starts only once each of its CSI volumes'
// VolumeAttachment is attached (the CSI attacher's WaitForAttach); and
// node.status.volumesInUse lists the volumes of the Pods that have not
// terminated, so the controller does not detach what is mounted.

import (
	"context"
	"crypto/sha256"
	"fmt"
	"slices"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/util/retry"
)

// annControllerManagedAttach on a Node hands attach and detach of its
// volumes to the attach/detach controller (the kubelet's default).
const annControllerManagedAttach = "volumes.kubernetes.io/controller-managed-attach-detach"

// attachmentName is the VolumeAttachment the attach/detach controller makes
// for a CSI volume on a node (k8s.io/kubernetes pkg/volume/csi
// getAttachmentName).
func attachmentName(handle, driver, node string) string {
	return fmt.Sprintf("csi-%x", sha256.Sum256([]byte(handle+driver+node)))
}

// csiVolumeName is a CSI volume's unique name in node.status.volumesInUse
// and volumesAttached: kubernetes.io/csi/<driver>^<handle>.
func csiVolumeName(driver, handle string) corev1.UniqueVolumeName {
	return corev1.UniqueVolumeName("kubernetes.io/csi/" + driver + "^" + handle)
}

// nodeID is the driver's ID for the tenant's node: `<namespace>/<vm>`, as
// the KubeVirt driver's node plugin registers it.
func (k *kubelet) nodeID() string { return k.t.ns + "/" + k.vm }

// notAttached says why pv cannot be mounted yet for want of attachment, or "".
func (k *kubelet) notAttached(pv *corev1.PersistentVolume) string {
	name := attachmentName(pv.Spec.CSI.VolumeHandle, pv.Spec.CSI.Driver, simNodeName)
	va, err := k.vas.Get(name)
	switch {
	case err != nil:
		return fmt.Sprintf("waiting for volume %s to be attached: no VolumeAttachment %s yet", pv.Name, name)
	case va.Status.Attached:
		return ""
	case va.Status.AttachError != nil:
		return fmt.Sprintf("waiting for volume %s to be attached: VolumeAttachment %s: %s", pv.Name, name, va.Status.AttachError.Message)
	}
	return fmt.Sprintf("waiting for volume %s to be attached (VolumeAttachment %s)", pv.Name, name)
}

// attachmentChanged requeues the Pods of this node that wait to start.
func (k *kubelet) attachmentChanged(obj any) {
	va, ok := obj.(*storagev1.VolumeAttachment)
	if !ok || k.pods == nil || va.Spec.NodeName != simNodeName {
		return
	}
	pods, _ := k.pods.List(labels.Everything())
	for _, p := range pods {
		if !podStarted(p) {
			k.q.Add(p.Namespace + "/" + p.Name)
		}
	}
}

// volumesInUse are the CSI volumes of this driver used by the node's Pods
// that have not terminated (those being deleted included, until the
// kubelet confirmed them gone), sorted.
func (k *kubelet) volumesInUse() []corev1.UniqueVolumeName {
	var out []corev1.UniqueVolumeName
	pods, _ := k.pods.List(labels.Everything())
	for _, p := range pods {
		if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		for _, claim := range podClaims(p) {
			pvc, err := k.pvcs.PersistentVolumeClaims(p.Namespace).Get(claim)
			if err != nil || pvc.Spec.VolumeName == "" {
				continue
			}
			pv, err := k.pvs.Get(pvc.Spec.VolumeName)
			if err != nil || pv.Spec.CSI == nil || pv.Spec.CSI.Driver != k.t.s.cfg.driver {
				continue
			}
			out = append(out, csiVolumeName(pv.Spec.CSI.Driver, pv.Spec.CSI.VolumeHandle))
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// tenantNode is what a tenant's kubelet reports on its Node beyond the
// common heartbeat: attach/detach by the controller, and the volumes in
// use (left as they are until the caches have synced: a restarted kubelet
// must not report its mounted volumes unused).
func (k *kubelet) tenantNode(node *corev1.Node) {
	if node.Annotations == nil {
		node.Annotations = map[string]string{}
	}
	node.Annotations[annControllerManagedAttach] = "true"
	// Cluster API's Machine controller finds the Node by it.
	if k.t.capi {
		node.Spec.ProviderID = capiProviderID(k.t.ns, k.t.name)
	} else {
		node.Spec.ProviderID = capkProviderIDScheme + k.vm
	}
	if !k.synced.Load() {
		return
	}
	inUse := k.volumesInUse()
	node.Status.VolumesInUse = inUse
	k.inUseMu.Lock()
	k.inUse = inUse
	k.inUseMu.Unlock()
}

// reportInUse writes node.status.volumesInUse when it changed, at once (a
// real kubelet's next status update is up to 10 s away).
func (k *kubelet) reportInUse(ctx context.Context) error {
	inUse := k.volumesInUse()
	k.inUseMu.Lock()
	defer k.inUseMu.Unlock()
	if slices.Equal(inUse, k.inUse) {
		return nil
	}
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		node, err := k.cs.CoreV1().Nodes().Get(ctx, simNodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		node.Status.VolumesInUse = inUse
		_, err = k.cs.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return fmt.Errorf("report volumes in use on node %s: %w", simNodeName, err)
	}
	k.inUse = inUse
	k.t.logf("kubelet", "volumes-in-use", "node %s: %d volumes in use", simNodeName, len(inUse))
	return nil
}

// registerCSINode records the driver's node ID on the node's CSINode, as
// the kubelet does when the driver's node plugin registers.
func (k *kubelet) registerCSINode(ctx context.Context) {
	want := storagev1.CSINodeDriver{Name: k.t.s.cfg.driver, NodeID: k.nodeID()}
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		api := k.cs.StorageV1().CSINodes()
		cn, err := api.Get(ctx, simNodeName, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			node, err := k.cs.CoreV1().Nodes().Get(ctx, simNodeName, metav1.GetOptions{})
			if err != nil {
				return err
			}
			_, err = api.Create(ctx, &storagev1.CSINode{
				ObjectMeta: metav1.ObjectMeta{Name: simNodeName, OwnerReferences: []metav1.OwnerReference{{
					APIVersion: "v1", Kind: "Node", Name: node.Name, UID: node.UID,
				}}},
				Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{want}},
			}, metav1.CreateOptions{})
			return err
		}
		if err != nil {
			return err
		}
		for _, d := range cn.Spec.Drivers {
			if d.Name == want.Name && d.NodeID == want.NodeID {
				return nil
			}
		}
		cn.Spec.Drivers = append(slices.DeleteFunc(cn.Spec.Drivers, func(d storagev1.CSINodeDriver) bool { return d.Name == want.Name }), want)
		_, err = api.Update(ctx, cn, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		k.t.logf("kubelet", "error", "register driver %s on CSINode %s: %v", want.Name, simNodeName, err)
		return
	}
	k.t.logf("kubelet", "csinode", "CSINode %s: driver %s, node ID %s", simNodeName, want.Name, want.NodeID)
}
