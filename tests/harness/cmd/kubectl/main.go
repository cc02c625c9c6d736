// Command kubectl is upstream kubectl (k8s.io/kubectl, the version the
// harness's go.mod pins), built as its own program, as upstream's
// cmd/kubectl does: a hook script's Pod runs it for every command, and
// linked into the harness it paid the start-up of every component the
// harness holds (measured on 2 cores: 94 ms of CPU per run against 48 ms).
package main

import (
	"k8s.io/component-base/cli"
	kubectl "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
)

func main() {
	if err := cli.RunNoErrOutput(kubectl.NewDefaultKubectlCommand()); err != nil {
		kubectlutil.CheckErr(err) // prints the error as kubectl does and exits
	}
}
