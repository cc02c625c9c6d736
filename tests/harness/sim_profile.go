package main

// The platform's names, read from the same profile volume-gate uses
// (`volume-gate profile` prints it; the Rust fixture writes it with
// `Profile::cozystack()`), so the simulated world and the product cannot
// disagree about what a parent, a child or the CSI release is called.
// Names that belong to other components (Flux's and Kamaji's finalizers,
// the chart's ServiceAccount) stay with the code that plays them.

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
)

type profileFile struct {
	Parent struct {
		MatchLabels map[string]string `json:"matchLabels"`
	} `json:"parent"`
	ChildLabel string `json:"childLabel"`
	CSIRelease string `json:"csiRelease"`
	Kubeconfig struct {
		SecretName string   `json:"secretName"`
		Keys       []string `json:"keys"`
	} `json:"kubeconfig"`
	Guarded []struct {
		Group string `json:"group"`
		Kind  string `json:"kind"`
		Label string `json:"label"`
	} `json:"guarded"`
	Release struct {
		NameLabel      string `json:"nameLabel"`
		NamespaceLabel string `json:"namespaceLabel"`
	} `json:"release"`
	Infra *struct {
		Group  string            `json:"group"`
		Kind   string            `json:"kind"`
		Labels map[string]string `json:"labels"`
	} `json:"infra"`
}

// infraNames is the profile's infra layer, as the simulator plays it.
type infraNames struct {
	labels map[string]string // label templates, {tenant} standing for R
}

// profileNames is what the simulator needs of a profile.
type profileNames struct {
	parentLabels       map[string]string
	childLabel         string
	csiSuffix          string // the CSI release is R + csiSuffix
	kubeconfigSuffix   string // the admin kubeconfig Secret is R + kubeconfigSuffix
	kubeconfigKeys     []string
	clusterLabel       string // Cluster API objects carry R under this label
	fluxNameLabel      string
	fluxNamespaceLabel string
	infra              *infraNames // nil: one storage layer
}

// prof is set once, before the simulator starts.
var prof profileNames

const tenantPlaceholder = "{tenant}"

func suffixOf(pattern, what string) (string, error) {
	s, ok := strings.CutPrefix(pattern, tenantPlaceholder)
	if !ok || s == "" {
		return "", fmt.Errorf("%s %q: the simulator supports only patterns of the form {tenant}-suffix", what, pattern)
	}
	return s, nil
}

func parseProfile(data []byte) (profileNames, error) {
	var p profileFile
	if err := json.Unmarshal(data, &p); err != nil {
		return profileNames{}, fmt.Errorf("profile is not the JSON `volume-gate profile` prints: %w", err)
	}
	n := profileNames{
		parentLabels:       p.Parent.MatchLabels,
		childLabel:         p.ChildLabel,
		kubeconfigKeys:     p.Kubeconfig.Keys,
		fluxNameLabel:      p.Release.NameLabel,
		fluxNamespaceLabel: p.Release.NamespaceLabel,
	}
	var err error
	if n.csiSuffix, err = suffixOf(p.CSIRelease, "csiRelease"); err != nil {
		return profileNames{}, err
	}
	if n.kubeconfigSuffix, err = suffixOf(p.Kubeconfig.SecretName, "kubeconfig.secretName"); err != nil {
		return profileNames{}, err
	}
	if p.Infra != nil {
		if p.Infra.Group != "cdi.kubevirt.io" || p.Infra.Kind != "DataVolume" {
			return profileNames{}, fmt.Errorf("infra %s.%s: the simulator plays only CDI DataVolumes", p.Infra.Kind, p.Infra.Group)
		}
		if len(p.Infra.Labels) == 0 {
			return profileNames{}, fmt.Errorf("infra has no labels")
		}
		n.infra = &infraNames{labels: p.Infra.Labels}
	}
	for _, g := range p.Guarded {
		if g.Group == "cluster.x-k8s.io" && g.Kind == "Cluster" && g.Label != "" {
			n.clusterLabel = g.Label
		}
	}
	switch {
	case len(n.parentLabels) == 0:
		return profileNames{}, fmt.Errorf("profile has no parent.matchLabels")
	case n.childLabel == "" || n.fluxNameLabel == "" || n.fluxNamespaceLabel == "":
		return profileNames{}, fmt.Errorf("profile lacks childLabel or release.nameLabel/namespaceLabel")
	case n.clusterLabel == "":
		return profileNames{}, fmt.Errorf("profile guards no cluster.x-k8s.io Cluster by label")
	case len(n.kubeconfigKeys) == 0:
		return profileNames{}, fmt.Errorf("profile has no kubeconfig.keys")
	}
	return n, nil
}

func loadProfile(path string) (profileNames, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return profileNames{}, fmt.Errorf("reading the profile: %w", err)
	}
	n, err := parseProfile(data)
	if err != nil {
		return profileNames{}, fmt.Errorf("%s: %w", path, err)
	}
	return n, nil
}
