package main

// The parts of KubeVirt the CSI driver talks to, on the management cluster
// (infra layer only):
//
//   - a VirtualMachineInstance for each VirtualMachine: a Cozystack
//     tenant's VMs are its KubevirtMachines', made by the played CAPK
//     (sim_cozystack_capi.go); a played Cluster API cluster's node
//     (sim_capi.go, whose infrastructure is not KubeVirt) gets the VM
//     `<cluster>-vm`, owned by its MachineDeployment (a machine's chain to
//     its VM collapsed), so garbage collection takes it with it;
//   - virt-api's subresources `addvolume` and `removevolume` of
//     subresources.kubevirt.io/v1, served by an HTTPS server of the
//     simulator behind an APIService, so Kubernetes' aggregator routes the
//     driver's PUTs and Kubernetes' RBAC authorizes them (the Service is an
//     ExternalName to localhost: the API server refuses loopback endpoints);
//     addvolume adds a hotpluggable DataVolume volume to the VM's spec,
//     removevolume takes it out (of the VM, or of the VMI's hotplug status);
//   - virt-controller's hotplug: for each hotpluggable volume in a VM's
//     spec, an attachment Pod (hp-volume-<dv>, mounting the disk's PVC on
//     the management node) and the VMI's status.volumeStatus entry, phase
//     Ready; a volume taken out loses both.

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/retry"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/ptr"
)

var (
	gvrVM         = schema.GroupVersionResource{Group: "kubevirt.io", Version: "v1", Resource: "virtualmachines"}
	gvrVMI        = schema.GroupVersionResource{Group: "kubevirt.io", Version: "v1", Resource: "virtualmachineinstances"}
	gvrAPIService = schema.GroupVersionResource{Group: "apiregistration.k8s.io", Version: "v1", Resource: "apiservices"}
)

const (
	virtNamespace   = "kubevirt"
	virtAPIService  = "virt-api"
	subresourcesAPI = "subresources.kubevirt.io"
)

// vmName is the VM of tenant R's node; the tenant's CSINode names it in
// the driver's node ID (`<namespace>/<vm>`).
func vmName(r string) string { return r + "-vm" }

type virt struct {
	s   *sim
	mds *lazyInformer
	vms *lazyInformer
	q   workqueue.TypedRateLimitingInterface[string] // VM keys
}

// startVirt serves virt-api and runs the VM and hotplug controllers.
func (s *sim) startVirt(ctx context.Context, factory dynamicinformer.DynamicSharedInformerFactory) {
	v := &virt{s: s, q: newItemQueue("virt")}
	enqueueVM := func(obj any) {
		if u, ok := tombstone(obj).(*unstructured.Unstructured); ok {
			v.q.Add(u.GetNamespace() + "/" + u.GetName())
		}
	}
	v.vms = newLazyInformer(s, factory, gvrVM, cache.ResourceEventHandlerFuncs{
		AddFunc: enqueueVM, UpdateFunc: func(_, obj any) { enqueueVM(obj) },
	})
	onMD := func(obj any) {
		if md, ok := tombstone(obj).(*unstructured.Unstructured); ok && md.GetDeletionTimestamp() == nil && playedMachines(md) {
			if r := md.GetLabels()[prof.clusterLabel]; r != "" {
				v.q.Add("md:" + md.GetNamespace() + "/" + md.GetName())
			}
		}
	}
	v.mds = newLazyInformer(s, factory, gvrMachineDeployment, cache.ResourceEventHandlerFuncs{
		AddFunc: onMD, UpdateFunc: func(_, obj any) { onMD(obj) },
	})
	s.wg.Go(func() { v.vms.run(ctx) })
	s.wg.Go(func() { v.mds.run(ctx) })
	s.wg.Go(func() {
		if err := v.serveAPI(ctx); err != nil && ctx.Err() == nil {
			s.log.printf("virt", "", "error", "virt-api: %v", err)
		}
	})
	s.wg.Go(func() { v.run(ctx) })
}

func (v *virt) run(ctx context.Context) {
	drain(ctx, v.q, func(ctx context.Context, key string) error {
		if mdKey, ok := strings.CutPrefix(key, "md:"); ok {
			return v.syncMachineDeployment(ctx, mdKey)
		}
		return v.syncVM(ctx, key)
	}, func(key string, err error) {
		v.s.log.printf("virt", "", "error", "%s: %v (retrying)", key, err)
	})
}

// playedMachines reports whether a MachineDeployment's machines are the
// played Cluster API world's (HarnessMachines), whose node gets a VM here.
func playedMachines(md *unstructured.Unstructured) bool {
	kind, _, _ := unstructured.NestedString(md.Object, "spec", "template", "spec", "infrastructureRef", "kind")
	return kind == "HarnessMachineTemplate"
}

// syncMachineDeployment makes the VM and VMI of a played Cluster API
// cluster's node, owned by its MachineDeployment.
func (v *virt) syncMachineDeployment(ctx context.Context, key string) error {
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	md, ok, _ := v.mds.get(ns, name)
	if !ok || md.GetDeletionTimestamp() != nil {
		return nil
	}
	r := md.GetLabels()[prof.clusterLabel]
	owner := []any{map[string]any{
		"apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "MachineDeployment", "name": md.GetName(), "uid": string(md.GetUID()),
	}}
	vm := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
		"metadata": map[string]any{
			"name": vmName(r), "namespace": ns, "labels": map[string]any{prof.clusterLabel: r}, "ownerReferences": owner,
		},
		"spec": map[string]any{"runStrategy": "Always", "template": map[string]any{"spec": map[string]any{
			"domain": map[string]any{"devices": map[string]any{"disks": []any{}}}, "volumes": []any{},
		}}},
	}}
	created, err := v.s.dyn.Resource(gvrVM).Namespace(ns).Create(ctx, vm, metav1.CreateOptions{})
	switch {
	case err == nil:
		v.s.log.printf("virt", ns+"/"+r, "vm", "created VirtualMachine %s for MachineDeployment %s", vmName(r), md.GetName())
	case apierrors.IsAlreadyExists(err):
		if created, err = v.s.dyn.Resource(gvrVM).Namespace(ns).Get(ctx, vmName(r), metav1.GetOptions{}); err != nil {
			return err
		}
	default:
		return fmt.Errorf("create VirtualMachine %s/%s: %w", ns, vmName(r), err)
	}
	return v.ensureVMI(ctx, created)
}

func (v *virt) ensureVMI(ctx context.Context, vm *unstructured.Unstructured) error {
	// Made only when missing: a namespace being deleted refuses every
	// create, one of an object that exists too, and the VM's hot-plugging
	// must go on there (the gate keeps the VM and its VMI until the
	// tenant's volumes are released).
	if _, err := v.s.dyn.Resource(gvrVMI).Namespace(vm.GetNamespace()).Get(ctx, vm.GetName(), metav1.GetOptions{}); err == nil {
		return nil
	}
	vmi := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
		"metadata": map[string]any{
			"name": vm.GetName(), "namespace": vm.GetNamespace(), "labels": toAny(vm.GetLabels()),
			"ownerReferences": []any{map[string]any{
				"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "name": vm.GetName(), "uid": string(vm.GetUID()),
				"controller": true, "blockOwnerDeletion": true,
			}},
		},
		"spec": map[string]any{},
	}}
	_, err := v.s.dyn.Resource(gvrVMI).Namespace(vm.GetNamespace()).Create(ctx, vmi, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create VirtualMachineInstance %s/%s: %w", vm.GetNamespace(), vm.GetName(), err)
	}
	return nil
}

// hotplugged are the names of the hotpluggable DataVolume volumes in a VM's spec.
func hotplugged(vm *unstructured.Unstructured) []string {
	vols, _, _ := unstructured.NestedSlice(vm.Object, "spec", "template", "spec", "volumes")
	var out []string
	for _, raw := range vols {
		vol, _ := raw.(map[string]any)
		if dv, ok := vol["dataVolume"].(map[string]any); ok && dv["hotpluggable"] == true {
			out = append(out, fmt.Sprint(dv["name"]))
		}
	}
	slices.Sort(out)
	return out
}

// syncVM is virt-controller's hotplug for one VM: an attachment Pod and a
// Ready volume status for each hotplugged volume, neither for the others.
func (v *virt) syncVM(ctx context.Context, key string) error {
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	vm, ok, _ := v.vms.get(ns, name)
	if !ok || vm.GetDeletionTimestamp() != nil {
		return nil
	}
	if err := v.ensureVMI(ctx, vm); err != nil {
		return err
	}
	want := hotplugged(vm)
	r := vm.GetLabels()[prof.clusterLabel]
	// Owned by the VMI, so they go with the VM (KubeVirt's owner is the
	// VMI's virt-launcher Pod, which is not played).
	vmi, err := v.s.dyn.Resource(gvrVMI).Namespace(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("VirtualMachineInstance %s/%s: %w", ns, name, err)
	}
	owner := &metav1.OwnerReference{APIVersion: "kubevirt.io/v1", Kind: "VirtualMachineInstance", Name: name, UID: vmi.GetUID(),
		Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true)}
	// A volume is hotplugged once its disk exists: the DataVolume's PVC
	// bound (virt-controller waits for the DataVolume to be ready).
	var ready []string
	for _, dv := range want {
		pvc, err := v.s.mgmt.CoreV1().PersistentVolumeClaims(ns).Get(ctx, dv, metav1.GetOptions{})
		if err != nil || pvc.Status.Phase != corev1.ClaimBound {
			v.q.AddAfter(key, time.Second)
			continue
		}
		if err := v.attachmentPod(ctx, ns, r, name, dv, owner); err != nil {
			return err
		}
		ready = append(ready, dv)
	}
	return v.editVolumeStatus(ctx, ns, name, func(statuses []any) ([]any, error) {
		var kept []any
		var had []string
		for _, raw := range statuses {
			st, _ := raw.(map[string]any)
			n := fmt.Sprint(st["name"])
			if slices.Contains(want, n) {
				kept = append(kept, st)
				had = append(had, n)
				continue
			}
			if err := v.detachPod(ctx, ns, r, name, n); err != nil {
				return nil, err
			}
		}
		for _, dv := range ready {
			if !slices.Contains(had, dv) {
				kept = append(kept, map[string]any{
					"name": dv, "phase": "Ready", "reason": "VolumeReady", "message": "Successfully attach hotplugged volume " + dv + " to VM",
					"hotplugVolume": map[string]any{"attachPodName": attachmentPod(dv)},
				})
			}
		}
		return kept, nil
	})
}

// editVolumeStatus rewrites VMI ns/name's status.volumeStatus with edit,
// writing only when it changed.
func (v *virt) editVolumeStatus(ctx context.Context, ns, name string, edit func([]any) ([]any, error)) error {
	vmis := v.s.dyn.Resource(gvrVMI).Namespace(ns)
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		vmi, err := vmis.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		statuses, _, _ := unstructured.NestedSlice(vmi.Object, "status", "volumeStatus")
		edited, err := edit(slices.Clone(statuses))
		if err != nil {
			return err
		}
		if reflect.DeepEqual(edited, statuses) {
			return nil
		}
		if err := unstructured.SetNestedSlice(vmi.Object, edited, "status", "volumeStatus"); err != nil {
			return err
		}
		_, err = vmis.UpdateStatus(ctx, vmi, metav1.UpdateOptions{})
		return err
	})
}

// attachmentPod is the Pod that holds DataVolume dv's PVC for the VM.
func (v *virt) attachmentPod(ctx context.Context, ns, r, vm, dv string, owner *metav1.OwnerReference) error {
	// Made only when missing (a namespace being deleted refuses every
	// create, one of a Pod that exists too).
	if _, err := v.s.mgmt.CoreV1().Pods(ns).Get(ctx, attachmentPod(dv), metav1.GetOptions{}); err == nil {
		return nil
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: attachmentPod(dv), Namespace: ns,
			Labels: map[string]string{attachmentLabel: attachmentValue, attachmentTenantLabel: r},
		},
		Spec: corev1.PodSpec{
			NodeName:                      jobsNodeName,
			TerminationGracePeriodSeconds: ptr.To[int64](0),
			Containers:                    []corev1.Container{{Name: "hotplug-disk", Image: "quay.io/kubevirt/virt-launcher"}},
			Volumes: []corev1.Volume{{Name: "disk", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: dv},
			}}},
		},
	}
	if owner != nil {
		pod.OwnerReferences = []metav1.OwnerReference{*owner}
	}
	_, err := v.s.mgmt.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
	switch {
	case err == nil:
		v.s.log.printf("driver", ns+"/"+r, "attached", "DataVolume %s to VM %s (Pod %s)", dv, vm, pod.Name)
	case !apierrors.IsAlreadyExists(err):
		return fmt.Errorf("attach %s: create Pod %s: %w", dv, pod.Name, err)
	}
	return nil
}

func (v *virt) detachPod(ctx context.Context, ns, r, vm, dv string) error {
	err := v.s.mgmt.CoreV1().Pods(ns).Delete(ctx, attachmentPod(dv), metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)})
	switch {
	case err == nil:
		v.s.log.printf("driver", ns+"/"+r, "detached", "DataVolume %s from VM %s (Pod %s deleted)", dv, vm, attachmentPod(dv))
	case !apierrors.IsNotFound(err):
		return fmt.Errorf("detach %s: %w", dv, err)
	}
	return nil
}

// serveAPI serves virt-api's subresources on loopback and registers them
// with the management API server's aggregator.
func (v *virt) serveAPI(ctx context.Context) error {
	cert, caPEM, err := selfSigned(virtAPIService+"."+virtNamespace+".svc", "localhost")
	if err != nil {
		return err
	}
	host := "127.0.0.1"
	if v.s.cfg.nodeIP != "" {
		host = v.s.cfg.nodeIP
	}
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return err
	}
	port := l.Addr().(*net.TCPAddr).Port
	mux := http.NewServeMux()
	mux.HandleFunc("GET /apis/"+subresourcesAPI+"/v1", v.discovery)
	mux.HandleFunc("PUT /apis/"+subresourcesAPI+"/v1/namespaces/{ns}/{kind}/{name}/{op}", v.subresource)
	srv := &http.Server{Handler: mux, TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12},
		ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	go func() { _ = srv.ServeTLS(l, "", "") }()
	if err := v.register(ctx, port, caPEM); err != nil {
		return err
	}
	v.s.log.printf("virt", "", "started", "virt-api %s/v1 on %s:%d (APIService v1.%s, Service %s/%s)", subresourcesAPI, host, port, subresourcesAPI, virtNamespace, virtAPIService)
	<-ctx.Done()
	return nil
}

// register points APIService v1.subresources.kubevirt.io at this server:
// an ExternalName Service to localhost (the aggregator resolves it to the
// name; it refuses loopback endpoints) and the server's CA.
func (v *virt) register(ctx context.Context, port int, caPEM []byte) error {
	_, err := v.s.mgmt.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: virtNamespace}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("namespace %s: %w", virtNamespace, err)
	}
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: virtAPIService, Namespace: virtNamespace},
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeExternalName, ExternalName: "localhost",
			Ports: []corev1.ServicePort{{Name: "https", Port: int32(port)}}},
	}
	if v.s.cfg.nodeIP != "" {
		// Routing to endpoints: a headless Service and its one endpoint,
		// this server on the node's IP.
		svc.Spec = corev1.ServiceSpec{Type: corev1.ServiceTypeClusterIP, ClusterIP: corev1.ClusterIPNone,
			Ports: []corev1.ServicePort{{Name: "https", Port: int32(port)}}}
		slice := &discoveryv1.EndpointSlice{
			ObjectMeta: metav1.ObjectMeta{Name: virtAPIService, Namespace: virtNamespace,
				Labels: map[string]string{discoveryv1.LabelServiceName: virtAPIService}},
			AddressType: discoveryv1.AddressTypeIPv4,
			Endpoints: []discoveryv1.Endpoint{{Addresses: []string{v.s.cfg.nodeIP},
				Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}}},
			Ports: []discoveryv1.EndpointPort{{Name: ptr.To("https"), Port: ptr.To(int32(port)), Protocol: ptr.To(corev1.ProtocolTCP)}},
		}
		slices := v.s.mgmt.DiscoveryV1().EndpointSlices(virtNamespace)
		if old, err := slices.Get(ctx, slice.Name, metav1.GetOptions{}); err == nil {
			slice.ResourceVersion = old.ResourceVersion
			_, err = slices.Update(ctx, slice, metav1.UpdateOptions{})
			if err != nil {
				return fmt.Errorf("update EndpointSlice %s/%s: %w", virtNamespace, slice.Name, err)
			}
		} else if _, err := slices.Create(ctx, slice, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create EndpointSlice %s/%s: %w", virtNamespace, slice.Name, err)
		}
	}
	services := v.s.mgmt.CoreV1().Services(virtNamespace)
	if old, err := services.Get(ctx, svc.Name, metav1.GetOptions{}); err == nil {
		old.Spec.Ports = svc.Spec.Ports
		_, err = services.Update(ctx, old, metav1.UpdateOptions{})
		if err != nil {
			return fmt.Errorf("update Service %s/%s: %w", virtNamespace, svc.Name, err)
		}
	} else if _, err := services.Create(ctx, svc, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create Service %s/%s: %w", virtNamespace, svc.Name, err)
	}
	apiSvc := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
		"metadata": map[string]any{"name": "v1." + subresourcesAPI},
		"spec": map[string]any{
			"group": subresourcesAPI, "version": "v1", "groupPriorityMinimum": int64(1000), "versionPriority": int64(15),
			"service":  map[string]any{"namespace": virtNamespace, "name": virtAPIService, "port": int64(port)},
			"caBundle": caPEM,
		},
	}}
	apis := v.s.dyn.Resource(gvrAPIService)
	old, err := apis.Get(ctx, apiSvc.GetName(), metav1.GetOptions{})
	if err == nil {
		apiSvc.SetResourceVersion(old.GetResourceVersion())
		_, err = apis.Update(ctx, apiSvc, metav1.UpdateOptions{})
	} else {
		_, err = apis.Create(ctx, apiSvc, metav1.CreateOptions{})
	}
	if err != nil {
		return fmt.Errorf("APIService v1.%s: %w", subresourcesAPI, err)
	}
	return nil
}

func (v *virt) discovery(w http.ResponseWriter, _ *http.Request) {
	var resources []metav1.APIResource
	for _, kind := range []string{"virtualmachines", "virtualmachineinstances"} {
		for _, op := range []string{"addvolume", "removevolume"} {
			resources = append(resources, metav1.APIResource{Name: kind + "/" + op, Namespaced: true, Kind: "Status", Verbs: []string{"update"}})
		}
	}
	writeJSON(w, http.StatusOK, &metav1.APIResourceList{
		TypeMeta:     metav1.TypeMeta{Kind: "APIResourceList", APIVersion: "v1"},
		GroupVersion: subresourcesAPI + "/v1", APIResources: resources,
	})
}

// subresource is PUT .../namespaces/{ns}/{virtualmachines|virtualmachineinstances}/{name}/{addvolume|removevolume}.
// The aggregator has authenticated and authorized the caller (RBAC on
// the subresource); what it asks is done with the simulator's rights, as
// virt-api acts with its own.
func (v *virt) subresource(w http.ResponseWriter, r *http.Request) {
	ns, kind, name, op := r.PathValue("ns"), r.PathValue("kind"), r.PathValue("name"), r.PathValue("op")
	var body struct {
		Name         string `json:"name"`
		VolumeSource struct {
			DataVolume *struct {
				Name string `json:"name"`
			} `json:"dataVolume"`
		} `json:"volumeSource"`
		Disk map[string]any `json:"disk"`
	}
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&body); err != nil || body.Name == "" {
		writeStatus(w, http.StatusBadRequest, fmt.Sprintf("the request body is not a %s options object with a name", op))
		return
	}
	var err error
	switch {
	case kind == "virtualmachines" && op == "addvolume":
		if body.VolumeSource.DataVolume == nil {
			writeStatus(w, http.StatusBadRequest, "only dataVolume volumes are hotplugged here")
			return
		}
		err = v.editVM(r.Context(), ns, name, func(vols, disks []any) ([]any, []any, error) {
			for _, raw := range vols {
				if m, _ := raw.(map[string]any); m["name"] == body.Name {
					return nil, nil, apierrors.NewConflict(schema.GroupResource{Group: "kubevirt.io", Resource: "virtualmachines"}, name,
						fmt.Errorf("unable to add volume [%s] because volume with that name already exists", body.Name))
				}
			}
			disk := map[string]any{"name": body.Name}
			for k, val := range body.Disk {
				disk[k] = val
			}
			return append(vols, map[string]any{"name": body.Name, "dataVolume": map[string]any{
					"name": body.VolumeSource.DataVolume.Name, "hotpluggable": true}}),
				append(disks, disk), nil
		})
	case kind == "virtualmachines" && op == "removevolume":
		err = v.editVM(r.Context(), ns, name, func(vols, disks []any) ([]any, []any, error) {
			n := len(vols)
			vols = slices.DeleteFunc(vols, func(raw any) bool { m, _ := raw.(map[string]any); return m["name"] == body.Name })
			if len(vols) == n {
				return nil, nil, apierrors.NewNotFound(schema.GroupResource{Group: "kubevirt.io", Resource: "volumes"}, body.Name)
			}
			disks = slices.DeleteFunc(disks, func(raw any) bool { m, _ := raw.(map[string]any); return m["name"] == body.Name })
			return vols, disks, nil
		})
	case kind == "virtualmachineinstances" && op == "removevolume":
		// A VMI's hotplug (no VM spec entry): unplug it from the VMI.
		err = v.unplugVMI(r.Context(), ns, name, body.Name)
	default:
		writeStatus(w, http.StatusNotFound, fmt.Sprintf("%s/%s is not served here", kind, op))
		return
	}
	if err != nil {
		code := http.StatusInternalServerError
		if s, ok := err.(apierrors.APIStatus); ok {
			code = int(s.Status().Code)
		}
		writeStatus(w, code, err.Error())
		return
	}
	w.WriteHeader(http.StatusAccepted)
}

// editVM changes a VM's volumes and disks, and has the hotplug controller
// look at it at once.
func (v *virt) editVM(ctx context.Context, ns, name string, edit func(vols, disks []any) ([]any, []any, error)) error {
	vms := v.s.dyn.Resource(gvrVM).Namespace(ns)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		vm, err := vms.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		vols, _, _ := unstructured.NestedSlice(vm.Object, "spec", "template", "spec", "volumes")
		disks, _, _ := unstructured.NestedSlice(vm.Object, "spec", "template", "spec", "domain", "devices", "disks")
		vols, disks, err = edit(vols, disks)
		if err != nil {
			return err
		}
		if err := unstructured.SetNestedSlice(vm.Object, vols, "spec", "template", "spec", "volumes"); err != nil {
			return err
		}
		if err := unstructured.SetNestedSlice(vm.Object, disks, "spec", "template", "spec", "domain", "devices", "disks"); err != nil {
			return err
		}
		_, err = vms.Update(ctx, vm, metav1.UpdateOptions{})
		return err
	})
	if err == nil {
		v.q.Add(ns + "/" + name)
	}
	return err
}

func (v *virt) unplugVMI(ctx context.Context, ns, name, volume string) error {
	r := ""
	if vm, ok, _ := v.vms.get(ns, name); ok {
		r = vm.GetLabels()[prof.clusterLabel]
	}
	return v.editVolumeStatus(ctx, ns, name, func(statuses []any) ([]any, error) {
		n := len(statuses)
		statuses = slices.DeleteFunc(statuses, func(raw any) bool { m, _ := raw.(map[string]any); return m["name"] == volume })
		if len(statuses) < n {
			if err := v.detachPod(ctx, ns, r, name, volume); err != nil {
				return nil, err
			}
		}
		return statuses, nil
	})
}

func writeStatus(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, &metav1.Status{
		TypeMeta: metav1.TypeMeta{Kind: "Status", APIVersion: "v1"},
		Status:   metav1.StatusFailure, Message: msg, Code: int32(code), Reason: metav1.StatusReason(http.StatusText(code)),
	})
}

// selfSigned is a serving certificate for names, its own CA (PEM), made
// once per simulator run.
func selfSigned(names ...string) (tls.Certificate, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	serial, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: names[0]}, DNSNames: names,
		NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, BasicConstraintsValid: true, IsCA: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	cert, err := tls.X509KeyPair(certPEM, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}))
	return cert, certPEM, err
}
