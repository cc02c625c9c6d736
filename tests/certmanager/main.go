// Command cert-manager is a cut-down build of cert-manager v1.21 for the
// volume-gate tests: the controller (selfSigned and CA issuers, Certificate
// and CertificateRequest controllers) and the cainjector (webhook
// configurations only), in one binary with two subcommands.
//
// Upstream's cmd/controller and cmd/cainjector are separate Go modules that
// the module proxy does not serve, so this file wires the root module's
// public packages the way cmd/controller/app and cmd/cainjector/app do.
// Nothing listens on a port: no metrics, health, profiling or webhook
// servers, and no leader election.
//
//	cert-manager controller --kubeconfig FILE [--namespace NS] [--workers N] [-v N]
//	cert-manager cainjector --kubeconfig FILE [--namespace NS] [-v N]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"golang.org/x/sync/errgroup"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	kscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	cmapi "github.com/cert-manager/cert-manager/pkg/apis/certmanager/v1"
	"github.com/cert-manager/cert-manager/pkg/controller"
	"github.com/cert-manager/cert-manager/pkg/controller/cainjector"
	logf "github.com/cert-manager/cert-manager/pkg/logs"
	"github.com/cert-manager/cert-manager/pkg/util"

	// Each blank import below registers exactly one controller (or issuer
	// type) through its init(); the controller subcommand runs every
	// controller registered, so this list *is* the enabled set.

	// Issuer controller: validates Issuers and sets their Ready condition
	// (the CA issuer checks that spec.ca.secretName holds a CA key pair).
	_ "github.com/cert-manager/cert-manager/pkg/controller/issuers"
	// The issuer implementations the issuers controller can set up.
	_ "github.com/cert-manager/cert-manager/pkg/issuer/ca"
	_ "github.com/cert-manager/cert-manager/pkg/issuer/selfsigned"

	// The Certificate pipeline, as in upstream's default set:
	// trigger: sets Issuing=True when the Secret is missing, stale or due for renewal.
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/trigger"
	// keymanager: generates the next private key into a temporary Secret.
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/keymanager"
	// requestmanager: creates a CertificateRequest for the next revision.
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/requestmanager"
	// issuing: copies the signed certificate and key into spec.secretName.
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/issuing"
	// readiness: sets the Certificate's Ready condition and renewal time.
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/readiness"
	// revisionmanager: garbage-collects old CertificateRequests (revisionHistoryLimit).
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/revisionmanager"

	// CertificateRequest controllers.
	// approver: with no policy engine installed, upstream approves every
	// request; signers wait for Approved=True.
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificaterequests/approver"
	// Signers for the two issuer types the tests use.
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificaterequests/ca"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificaterequests/selfsigned"
)

func usage() {
	fmt.Fprintf(os.Stderr, "usage: %s controller|cainjector --kubeconfig FILE [--namespace NS] [flags]\n", os.Args[0])
	os.Exit(2)
}

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	cmd := os.Args[1]
	fs := flag.NewFlagSet(cmd, flag.ExitOnError)
	klog.InitFlags(fs) // -v N etc.
	kubeconfig := fs.String("kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig file (default $KUBECONFIG, else in-cluster)")
	namespace := fs.String("namespace", "", "watch only this namespace (default: all)")
	workers := fs.Int("workers", 5, "controller: workers per controller")
	_ = fs.Parse(os.Args[2:])

	logf.InitLogs()
	ctrl.SetLogger(klog.Background()) // controller-runtime logs through klog too

	// SIGTERM/SIGINT cancel the context; everything then returns.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	ctx = logf.NewContext(ctx, logf.Log, cmd)

	var err error
	switch cmd {
	case "controller":
		err = runController(ctx, *kubeconfig, *namespace, *workers)
	case "cainjector":
		err = runCAInjector(ctx, *kubeconfig, *namespace)
	default:
		usage()
	}
	if err != nil && !errors.Is(err, context.Canceled) {
		klog.ErrorS(err, "exiting")
		logf.FlushLogs()
		os.Exit(1)
	}
	logf.FlushLogs()
}

// runController mirrors upstream cmd/controller/app.Run: build one
// ContextFactory, construct every registered controller, start the shared
// informer factories, then run the controllers until ctx ends.
func runController(ctx context.Context, kubeconfig, namespace string, workers int) error {
	opts := controller.ContextOptions{
		Kubeconfig:         kubeconfig,
		Namespace:          namespace,
		KubernetesAPIQPS:   20, // upstream defaults
		KubernetesAPIBurst: 50,
	}
	// Upstream defaults for the options the enabled controllers read.
	opts.ClusterResourceNamespace = "kube-system" // only used by ClusterIssuers
	opts.CopiedAnnotationPrefixes = []string{"*", "-kubectl.kubernetes.io/", "-fluxcd.io/", "-argocd.argoproj.io/"}
	opts.CertificateRequestMinimumBackoffDuration = time.Hour
	opts.CertificateRequestMaximumBackoffDuration = 32 * time.Hour

	factory, err := controller.NewContextFactory(ctx, opts)
	if err != nil {
		return err
	}
	shared, err := factory.Build()
	if err != nil {
		return err
	}

	g, gctx := errgroup.WithContext(ctx)
	for name, construct := range controller.Known() {
		c, err := construct(factory)
		if err != nil {
			return fmt.Errorf("constructing controller %s: %w", name, err)
		}
		klog.InfoS("starting controller", "controller", name)
		g.Go(func() error { return c.Run(workers, gctx) })
	}
	// Informers are requested by the controllers' Register above; the
	// factories only start the informers requested so far. The metadata and
	// Gateway API factories stay idle (ACME and gateway-shim are not built).
	shared.SharedInformerFactory.Start(gctx.Done())
	shared.KubeSharedInformerFactory.Start(gctx.Done())
	return g.Wait()
}

// runCAInjector mirrors upstream cmd/cainjector/app: a controller-runtime
// manager running cainjector's reconcilers, here only for
// Validating/MutatingWebhookConfigurations, with the Certificate data source
// on so that cert-manager.io/inject-ca-from: <ns>/<certificate> works.
func runCAInjector(ctx context.Context, kubeconfig, namespace string) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	cfg = util.RestConfigWithUserAgent(cfg, "cainjector")

	scheme := runtime.NewScheme()
	utilruntime.Must(kscheme.AddToScheme(scheme)) // core, admissionregistration
	utilruntime.Must(cmapi.AddToScheme(scheme))   // Certificates

	var nsCache map[string]cache.Config
	if namespace != "" {
		// Cluster-scoped webhook configurations are still watched; only
		// namespaced reads (Secrets, Certificates) are restricted.
		nsCache = map[string]cache.Config{namespace: {}}
	}
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme: scheme,
		Cache:  cache.Options{DefaultNamespaces: nsCache},
		// As upstream: Secrets are read straight from the API server (the
		// watches use metadata only), so Secret data is never cached.
		Client:                 client.Options{Cache: &client.CacheOptions{DisableFor: []client.Object{&corev1.Secret{}}}},
		Metrics:                metricsserver.Options{BindAddress: "0"}, // no metrics listener
		HealthProbeBindAddress: "",                                      // no health listener
		LeaderElection:         false,
	})
	if err != nil {
		return err
	}
	if err := cainjector.RegisterAllInjectors(ctx, mgr, cainjector.SetupOptions{
		Namespace:                    namespace,
		EnableCertificatesDataSource: true,
		EnabledReconcilersFor: map[string]bool{
			cainjector.ValidatingWebhookConfigurationName: true,
			cainjector.MutatingWebhookConfigurationName:   true,
			// APIService and CRD conversion injection are not needed.
		},
	}); err != nil {
		return err
	}
	return mgr.Start(ctx)
}
