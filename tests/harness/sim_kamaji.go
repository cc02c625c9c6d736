package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
)

// kamaji stands in for the part of Kamaji that matters here: when a
// TenantControlPlane is deleted (by the hook, by a namespace deletion, by
// anyone) the tenant API server it runs goes away. The harness cluster that
// plays that API server is named by the TCP's annotation
// harness.volume-gate.test/cluster and is stopped through the control API.
// The admin kubeconfig Secret, owned by the TCP, is left to the real
// garbage collector. While the TCP is there, its status reports the
// Kubernetes version its spec asks for as Ready (Kamaji's
// status.kubernetesResources.version, api/v1alpha1/
// tenantcontrolplane_status.go, 26.3.6-edge): the harness cluster already
// serves, and Kamaji's Cluster API provider waits for it.
type kamaji struct {
	s    *sim
	http *http.Client

	mu sync.Mutex
	// handled holds the UIDs of deleted TCPs already acted on.
	handled map[types.UID]bool
	// stopped maps a tenant ("N/R") to the UID of the deleted TCP that
	// stopped its API server; a new TCP of that name clears it.
	stopped map[string]types.UID
}

func newKamaji(s *sim) *kamaji {
	return &kamaji{
		s:       s,
		http:    &http.Client{Timeout: 2 * time.Minute, Transport: &http.Transport{Proxy: nil}},
		handled: map[types.UID]bool{},
		stopped: map[string]types.UID{},
	}
}

// stopped reports whether the tenant's API server was stopped because its
// TenantControlPlane was deleted.
func (k *kamaji) isStopped(ns, name string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	_, ok := k.stopped[ns+"/"+name]
	return ok
}

func (k *kamaji) controlPlanePresent(tcp *unstructured.Unstructured) {
	key := tcp.GetNamespace() + "/" + tcp.GetName()
	k.mu.Lock()
	if uid, ok := k.stopped[key]; ok && uid != tcp.GetUID() {
		delete(k.stopped, key)
	}
	k.mu.Unlock()
	want, _, _ := unstructured.NestedString(tcp.Object, "spec", "kubernetes", "version")
	have, _, _ := unstructured.NestedString(tcp.Object, "status", "kubernetesResources", "version", "version")
	state, _, _ := unstructured.NestedString(tcp.Object, "status", "kubernetesResources", "version", "status")
	if want == "" || (want == have && state == "Ready") || k.s.ctx.Err() != nil {
		return
	}
	// Not in the informer's event handler: a write, retried until it is
	// made (the informer does not resync).
	k.s.wg.Go(func() {
		patch, _ := json.Marshal(map[string]any{"status": map[string]any{"kubernetesResources": map[string]any{
			"version": map[string]any{"version": want, "status": "Ready"}}}})
		tcps := k.s.dyn.Resource(gvrTCP).Namespace(tcp.GetNamespace())
		err := wait.PollUntilContextCancel(k.s.ctx, time.Second, true,
			func(ctx context.Context) (bool, error) {
				_, err := tcps.Patch(ctx, tcp.GetName(), types.MergePatchType, patch, metav1.PatchOptions{}, "status")
				switch {
				case err == nil || apierrors.IsNotFound(err):
					return true, nil
				default:
					k.s.log.printf("kamaji", key, "error", "TenantControlPlane %s: report version %s: %v (retrying)", tcp.GetName(), want, err)
					return false, nil
				}
			})
		if err == nil {
			k.s.log.printf("kamaji", key, "version", "TenantControlPlane %s: Kubernetes %s Ready", tcp.GetName(), want)
		}
	})
}

func (k *kamaji) controlPlaneDeleted(tcp *unstructured.Unstructured) {
	key := tcp.GetNamespace() + "/" + tcp.GetName()
	k.mu.Lock()
	if k.handled[tcp.GetUID()] {
		k.mu.Unlock()
		return
	}
	k.handled[tcp.GetUID()] = true
	k.stopped[key] = tcp.GetUID()
	k.mu.Unlock()

	cluster := tcp.GetAnnotations()[annHarnessCluster]
	if k.s.ctx.Err() != nil {
		return
	}
	// The control API call takes seconds (the components get a grace
	// period); the informer's event handler must not wait for it.
	k.s.wg.Go(func() {
		ctx := k.s.ctx
		if cluster == "" {
			k.s.log.printf("kamaji", key, "no-cluster", "TenantControlPlane %s deleted; no %s annotation, no API server to stop", tcp.GetName(), annHarnessCluster)
		} else {
			k.s.log.printf("kamaji", key, "stopping", "TenantControlPlane %s deleted: stopping tenant API server (harness cluster %s)", tcp.GetName(), cluster)
			if err := k.stopCluster(ctx, cluster); err != nil {
				k.s.log.printf("kamaji", key, "error", "stop harness cluster %s: %v", cluster, err)
			} else {
				k.s.log.printf("kamaji", key, "stopped", "tenant API server (harness cluster %s) stopped", cluster)
			}
		}
		// As Kamaji does once its API server is gone.
		tcps := k.s.dyn.Resource(gvrTCP).Namespace(tcp.GetNamespace())
		if removed, err := removeFinalizerDynamic(ctx, tcps, tcp.GetName(), tcp.GetUID(), kamajiFinalizer); err != nil {
			k.s.log.printf("kamaji", key, "error", "remove finalizer %s: %v", kamajiFinalizer, err)
		} else if removed {
			k.s.log.printf("kamaji", key, "finalizer-removed", "TenantControlPlane %s: %s removed", tcp.GetName(), kamajiFinalizer)
		}
	})
}

func (k *kamaji) stopCluster(ctx context.Context, cluster string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodDelete, k.s.cfg.control+"/clusters/"+cluster, nil)
	if err != nil {
		return err
	}
	resp, err := k.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("DELETE %s: %s: %s", req.URL, resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}
