package main

// The disk path as Cozystack runs it: Kubernetes' own CSI sidecars against a
// CSI controller plugin served here.
//
// A provisioner is two parts. Kubernetes' external-provisioner (the real
// one, built from its Go module by tests/csi/build.sh and run as a child
// process with the flags Cozystack's R-kcsi-controller Deployment passes)
// watches the claims and PVs of its cluster through a kubeconfig (a
// tenant's: the admin kubeconfig Secret's content, as the Pod mounts it)
// and calls CreateVolume / DeleteVolume over a unix socket. Everything
// Kubernetes decides (when to provision, when a PV is released, its
// finalizer, the retry schedule, refusing DeleteVolume while a
// VolumeAttachment names the PV) is therefore Kubernetes' own code. The
// plugin (csiPlugin) is the storage side: it makes and frees disks through
// a volumeBackend (the ledger, or DataVolumes in the management cluster,
// sim_infra.go).
//
// The plugin follows the KubeVirt CSI driver's controller
// (github.com/kubevirt/csi-driver pkg/service/controller.go,
// ControllerService.CreateVolume and .DeleteVolume): the volume ID is the
// request's name (`pvc-<claim UID>`), DeleteVolume of a volume that is not
// there succeeds, an error from the storage is returned as it is (gRPC
// code Unknown), so the provisioner reports it in an Event on the PV and
// retries.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// csiPlugin is the CSI Identity and Controller service of one provisioner.
type csiPlugin struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer

	name    string
	backend volumeBackend
	// attach: the driver attaches volumes to nodes (PUBLISH_UNPUBLISH_VOLUME,
	// as the KubeVirt driver does); its CSIDriver says attachRequired and
	// the external-attacher runs beside it.
	attach bool
	// claim finds the claim a volume is created for, by its UID (the
	// request's name is `pvc-<uid>`); nil when not (yet) known.
	claim func(uid string) *corev1.PersistentVolumeClaim
	// slow is how this driver takes its time to free a volume after it was
	// first asked to (annFreeAfter); nil or zero: at once.
	slow func() slowness
	logf func(component, action, format string, args ...any)

	mu  sync.Mutex
	due map[string]time.Time // when a slow driver frees a volume, by volume ID
	// lastDue is the latest time in due, for a driver freeing serially.
	lastDue time.Time
}

func (p *csiPlugin) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: p.name, VendorVersion: "volume-gate-harness"}, nil
}

func (p *csiPlugin) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{{
		Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_CONTROLLER_SERVICE}},
	}}}, nil
}

func (p *csiPlugin) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{}, nil
}

func (p *csiPlugin) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	rpc := func(t csi.ControllerServiceCapability_RPC_Type) *csi.ControllerServiceCapability {
		return &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: t}}}
	}
	caps := []*csi.ControllerServiceCapability{
		rpc(csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME),
		rpc(csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT),
		rpc(csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS),
	}
	if p.attach {
		caps = append(caps, rpc(csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME))
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

// ControllerPublishVolume attaches a volume to a node, as the KubeVirt
// driver's does (ControllerService.ControllerPublishVolume): volume ID,
// node ID and capability are required; the node ID is `<namespace>/<vm>`
// (CSINode), the namespace part ignored.
func (p *csiPlugin) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	if !p.attach {
		return nil, status.Error(codes.Unimplemented, "this driver does not attach volumes")
	}
	id, node := req.GetVolumeId(), req.GetNodeId()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume ID missing in request")
	case node == "":
		return nil, status.Error(codes.InvalidArgument, "node ID missing in request")
	case req.GetVolumeCapability() == nil:
		return nil, status.Error(codes.InvalidArgument, "volume capability missing in request")
	}
	if err := p.backend.publish(ctx, id, node); err != nil {
		p.logf("driver", "error", "ControllerPublishVolume %s to %s: %v", id, node, err)
		return nil, err
	}
	p.logf("driver", "published", "handle=%s node=%s", id, node)
	return &csi.ControllerPublishVolumeResponse{}, nil
}

// ControllerUnpublishVolume detaches it (ControllerService.
// ControllerUnpublishVolume): a volume not attached is success.
func (p *csiPlugin) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	if !p.attach {
		return nil, status.Error(codes.Unimplemented, "this driver does not attach volumes")
	}
	id, node := req.GetVolumeId(), req.GetNodeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID missing in request")
	}
	if err := p.backend.unpublish(ctx, id, node); err != nil {
		p.logf("driver", "error", "ControllerUnpublishVolume %s from %s: %v", id, node, err)
		return nil, err
	}
	p.logf("driver", "unpublished", "handle=%s node=%s", id, node)
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

func (p *csiPlugin) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	name := req.GetName()
	if name == "" {
		return nil, status.Error(codes.InvalidArgument, "name missing in request")
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "volume capabilities missing in request")
	}
	if src := req.GetVolumeContentSource(); src != nil {
		// The KubeVirt driver restores a snapshot or clones a volume as a
		// DataVolume with that source; this plugin does not play it, and a
		// blank disk in its place would be a lie.
		return nil, status.Errorf(codes.Unimplemented, "volume %s: creating from a content source (%v) is not played by this plugin", name, src)
	}
	bytes := req.GetCapacityRange().GetRequiredBytes()
	if bytes <= 0 {
		return nil, status.Errorf(codes.InvalidArgument, "volume %s: no required capacity", name)
	}
	uid, ok := strings.CutPrefix(name, "pvc-")
	if !ok {
		return nil, status.Errorf(codes.InvalidArgument, "volume name %q lacks the prefix pvc-", name)
	}
	pvc := p.claim(uid)
	if pvc == nil {
		// The provisioner saw the claim before this plugin's cache did:
		// a non-final code, so it retries.
		return nil, status.Errorf(codes.Unavailable, "claim with UID %s not seen yet", uid)
	}
	size := *resource.NewQuantity(bytes, resource.BinarySI)
	handle, err := p.backend.createVolume(ctx, name, pvc, size)
	if err != nil {
		p.logf("driver", "error", "CreateVolume %s for claim %s/%s: %v", name, pvc.Namespace, pvc.Name, err)
		return nil, err
	}
	p.logf("driver", "provisioned", "pv=%s claim=%s/%s handle=%s capacity=%s", name, pvc.Namespace, pvc.Name, handle, size.String())
	return &csi.CreateVolumeResponse{Volume: &csi.Volume{VolumeId: handle, CapacityBytes: bytes}}, nil
}

func (p *csiPlugin) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID missing in request")
	}
	if err := p.waitSlow(ctx, id); err != nil {
		return nil, err
	}
	if err := p.backend.deleteVolume(ctx, id); err != nil {
		p.logf("driver", "error", "DeleteVolume %s: %v", id, err)
		return nil, err
	}
	p.mu.Lock()
	delete(p.due, id)
	p.mu.Unlock()
	p.logf("driver", "deleted", "handle=%s (DeleteVolume done)", id)
	return &csi.DeleteVolumeResponse{}, nil
}

// waitSlow holds a DeleteVolume of a slow driver until the volume is due:
// its delay after the first call for it, or (serially) its delay after the
// volume before it is due. It waits within the call's own deadline (the
// provisioner's --timeout); past it, the next call goes on waiting.
func (p *csiPlugin) waitSlow(ctx context.Context, id string) error {
	if p.slow == nil {
		return nil
	}
	slow := p.slow()
	if slow.delay <= 0 {
		return nil
	}
	p.mu.Lock()
	due, ok := p.due[id]
	if !ok {
		start := time.Now()
		if slow.serially && p.lastDue.After(start) {
			start = p.lastDue
		}
		due = start.Add(slow.delay)
		p.due[id] = due
		if due.After(p.lastDue) {
			p.lastDue = due
		}
		p.logf("driver", "slow", "handle=%s freed no sooner than %s from now (%s)", id, time.Until(due).Round(time.Millisecond), annFreeAfter)
	}
	p.mu.Unlock()
	select {
	case <-time.After(time.Until(due)):
		return nil
	case <-ctx.Done():
		return status.FromContextError(ctx.Err()).Err()
	}
}

// csiServer serves a plugin on a unix socket until stopped.
type csiServer struct {
	srv  *grpc.Server
	done chan struct{}
}

func serveCSI(sock string, p *csiPlugin) (*csiServer, error) {
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	l, err := net.Listen("unix", sock)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", sock, err)
	}
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, p)
	csi.RegisterControllerServer(srv, p)
	s := &csiServer{srv: srv, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		_ = srv.Serve(l)
	}()
	return s, nil
}

func (s *csiServer) stop() {
	s.srv.Stop()
	<-s.done
}

// sidecarSpec is one of Kubernetes' sidecars beside a plugin.
type sidecarSpec struct {
	name string // "csi-provisioner", "csi-attacher": the binary in --sidecars
	args []string
}

// cozystackSidecars are the sidecars of Cozystack's R-kcsi-controller
// Deployment (packages/apps/kubernetes/templates/csi/deploy.yaml) with the
// flags it passes, but the socket's and the kubeconfig's paths: the
// provisioner and, for a driver that attaches, the attacher. Leader
// election stays off, as there: one replica.
func cozystackSidecars(sock, kubeconfig string, attach bool) []sidecarSpec {
	common := []string{
		"--csi-address=" + sock,
		"--kubeconfig=" + kubeconfig,
		"--v=5",
		"--timeout=3m",
		"--retry-interval-max=1m",
	}
	specs := []sidecarSpec{{name: "csi-provisioner", args: append(slices.Clone(common), "--default-fstype=ext4")}}
	if attach {
		specs = append(specs, sidecarSpec{name: "csi-attacher", args: slices.Clone(common)})
	}
	return specs
}

// runSidecars runs each sidecar as a child process until ctx ends,
// restarting one that exits (as the kubelet restarts a container, with a
// growing delay). Their output goes to logDir/<prefix>-<name>.log. It
// returns once all have stopped.
func runSidecars(ctx context.Context, bins, logDir, prefix string, specs []sidecarSpec, logf func(component, action, format string, args ...any)) {
	var wg sync.WaitGroup
	for _, sc := range specs {
		wg.Go(func() {
			path := filepath.Join(logDir, prefix+"-"+sc.name+".log")
			backoff := time.Second
			for ctx.Err() == nil {
				started := time.Now()
				err := runSidecar(ctx, filepath.Join(bins, sc.name), sc.args, path)
				if ctx.Err() != nil {
					return
				}
				if time.Since(started) > time.Minute {
					backoff = time.Second
				}
				logf("driver", "sidecar-exited", "%s exited (%v); restarting in %s; its log: %s", sc.name, err, backoff, path)
				select {
				case <-ctx.Done():
					return
				case <-time.After(backoff):
				}
				backoff = min(2*backoff, 30*time.Second)
			}
		})
	}
	wg.Wait()
}

// runSidecar runs one sidecar until it exits or ctx ends (then it gets
// SIGTERM, and SIGKILL 5 s later). It dies with the simulator
// (Pdeathsig), and without KUBECONFIG in its environment, which the
// external-provisioner would prefer to --kubeconfig.
func runSidecar(ctx context.Context, bin string, args []string, logPath string) error {
	out, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer out.Close()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = slices.DeleteFunc(os.Environ(), func(kv string) bool { return strings.HasPrefix(kv, "KUBECONFIG=") })
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 5 * time.Second
	return cmd.Run()
}
