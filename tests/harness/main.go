// Command harness runs the real Kubernetes control-plane components that
// volume-gate's tests stand on, one component per process, chosen by the
// first argument, and the launcher that starts and supervises them.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	kcm "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubeletapp "k8s.io/kubernetes/cmd/kubelet/app"
)

const usage = `usage: harness COMMAND [flags]

Components (one per process, flags as the upstream binaries):
  etcd | kube-apiserver | kube-controller-manager | kube-scheduler | kubelet
(kubectl is its own program, built beside this one: cmd/kubectl)

Launcher:
  up --state DIR [--owner-pid PID] [--tenant NAME]... [--timeout 3m] [--node]
  image --out FILE --name REF [--entrypoint JSON] [--cmd JSON] [--user U] [--env K=V]... [--file DST=SRC]... [--link DST=TARGET]...
  node import --state DIR FILE...
  down --state DIR
  env --state DIR
  cluster up|down NAME --state DIR
  supervise --state DIR --cluster NAME... (started by up)
`

var launcherCommands = map[string]func(args []string) error{
	"up":        cmdUp,
	"image":     cmdImage,
	"node":      cmdNode,
	"down":      cmdDown,
	"env":       cmdEnv,
	"cluster":   cmdCluster,
	"supervise": cmdSupervise,
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	command, args := os.Args[1], os.Args[2:]
	if run, ok := launcherCommands[command]; ok {
		if err := run(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				os.Exit(2)
			}
			fmt.Fprintf(os.Stderr, "harness %s: %v\n", command, err)
			os.Exit(1)
		}
		return
	}
	// Each component parses os.Args as if it were its own binary.
	os.Args = append([]string{command}, args...)
	switch command {
	case "etcd":
		etcdmain.Main(os.Args)
	case "kube-apiserver":
		os.Exit(cli.Run(apiserver.NewAPIServerCommand()))
	case "kube-controller-manager":
		os.Exit(cli.Run(kcm.NewControllerManagerCommand()))
	case "kube-scheduler":
		os.Exit(cli.Run(scheduler.NewSchedulerCommand()))
	case "kubelet":
		os.Exit(cli.Run(kubeletapp.NewKubeletCommand(context.Background())))
	case "sim":
		os.Exit(runSim(os.Args[1:]))
	case "pause":
		// A container that holds a Pod's place until it is stopped (the
		// tenant chart's CSI controller on the real node, whose work the
		// simulator does while it runs).
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
		<-ctx.Done()
		stop()
		os.Exit(0)
	default:
		fmt.Fprintf(os.Stderr, "harness: unknown command %q\n\n%s", command, usage)
		os.Exit(2)
	}
}

// kubectlBeside is the kubectl program build.sh installs beside the
// harness binary self.
func kubectlBeside(self string) (string, error) {
	path := filepath.Join(filepath.Dir(self), "kubectl")
	if _, err := os.Stat(path); err != nil {
		return "", fmt.Errorf("kubectl beside the harness: %w (tests/harness/build.sh builds both)", err)
	}
	return path, nil
}
