package main

// image.go: OCI image archives assembled without a daemon or a registry,
// for the management node's container runtime (node.go), which imports them
// under their real names (`ctr images import`). An archive is an OCI image
// layout in a tar (oci-layout, index.json, blobs/sha256/...): one
// uncompressed layer of the files named, a config (entrypoint, command,
// user, environment), a manifest, and an index whose entry carries the
// image's name in `io.containerd.image.name`, which is what containerd's
// importer names the image by.

import (
	"archive/tar"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

// imageSpec is one image: its name and what its single layer holds.
type imageSpec struct {
	Name       string
	Entrypoint []string
	Cmd        []string
	User       string
	Env        []string
	// Files maps a path in the image to a file on this machine (mode kept).
	Files map[string]string
	// Links maps a path in the image to a symlink target.
	Links map[string]string
}

// cmdImage: harness image --out FILE --name REF [--entrypoint JSON] [--cmd JSON]
// [--user UID:GID] [--env K=V]... [--file DST=SRC]... [--link DST=TARGET]...
func cmdImage(args []string) error {
	fs := flag.NewFlagSet("image", flag.ContinueOnError)
	out := fs.String("out", "", "archive to write (required)")
	name := fs.String("name", "", "image name, as the runtime will know it (required)")
	entrypoint := fs.String("entrypoint", "", "entrypoint, a JSON array")
	command := fs.String("cmd", "", "command, a JSON array")
	user := fs.String("user", "", "user (UID:GID)")
	var env, files, links names
	fs.Var(&env, "env", "K=V (repeatable)")
	fs.Var(&files, "file", "DST=SRC: file SRC of this machine at DST in the image (repeatable)")
	fs.Var(&links, "link", "DST=TARGET: a symlink at DST (repeatable)")
	if _, err := parseArgs(fs, args, 0); err != nil {
		return err
	}
	if *out == "" || *name == "" {
		return fmt.Errorf("--out and --name are required")
	}
	spec := imageSpec{Name: *name, User: *user, Env: env, Files: map[string]string{}, Links: map[string]string{}}
	for _, j := range []struct {
		flag string
		raw  string
		into *[]string
	}{{"--entrypoint", *entrypoint, &spec.Entrypoint}, {"--cmd", *command, &spec.Cmd}} {
		if j.raw == "" {
			continue
		}
		if err := json.Unmarshal([]byte(j.raw), j.into); err != nil {
			return fmt.Errorf("%s %q: not a JSON array of strings: %w", j.flag, j.raw, err)
		}
	}
	for _, f := range files {
		dst, src, ok := strings.Cut(f, "=")
		if !ok || !path.IsAbs(dst) || src == "" {
			return fmt.Errorf("--file %q: want /PATH/IN/IMAGE=SOURCE", f)
		}
		spec.Files[dst] = src
	}
	for _, l := range links {
		dst, target, ok := strings.Cut(l, "=")
		if !ok || !path.IsAbs(dst) || target == "" {
			return fmt.Errorf("--link %q: want /PATH/IN/IMAGE=TARGET", l)
		}
		spec.Links[dst] = target
	}
	return writeImage(*out, spec)
}

// writeImage writes spec as an OCI image layout archive at out.
func writeImage(out string, spec imageSpec) error {
	dir, err := os.MkdirTemp(filepath.Dir(out), ".image-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	layerPath := filepath.Join(dir, "layer.tar")
	layerDigest, layerSize, err := writeLayer(layerPath, spec)
	if err != nil {
		return fmt.Errorf("image %s: layer: %w", spec.Name, err)
	}
	config := map[string]any{
		"architecture": "amd64",
		"os":           "linux",
		"created":      time.Unix(0, 0).UTC().Format(time.RFC3339),
		"config": map[string]any{
			"Entrypoint": spec.Entrypoint,
			"Cmd":        spec.Cmd,
			"User":       spec.User,
			"Env":        spec.Env,
		},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{layerDigest}},
	}
	configJSON, err := json.Marshal(config)
	if err != nil {
		return err
	}
	manifest := map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.manifest.v1+json",
		"config": map[string]any{
			"mediaType": "application/vnd.oci.image.config.v1+json",
			"digest":    digestOf(configJSON), "size": len(configJSON),
		},
		"layers": []any{map[string]any{
			"mediaType": "application/vnd.oci.image.layer.v1.tar",
			"digest":    layerDigest, "size": layerSize,
		}},
	}
	manifestJSON, err := json.Marshal(manifest)
	if err != nil {
		return err
	}
	index := map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.index.v1+json",
		"manifests": []any{map[string]any{
			"mediaType": "application/vnd.oci.image.manifest.v1+json",
			"digest":    digestOf(manifestJSON), "size": len(manifestJSON),
			"annotations": map[string]string{
				"io.containerd.image.name":          spec.Name,
				"org.opencontainers.image.ref.name": refName(spec.Name),
			},
		}},
	}
	indexJSON, err := json.Marshal(index)
	if err != nil {
		return err
	}

	tmp := out + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	defer os.Remove(tmp)
	tw := tar.NewWriter(f)
	add := func(name string, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(data)), Typeflag: tar.TypeReg}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	blob := func(d string) string { return "blobs/sha256/" + strings.TrimPrefix(d, "sha256:") }
	for _, e := range []struct {
		name string
		data []byte
	}{
		{"oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)},
		{"index.json", indexJSON},
		{blob(digestOf(configJSON)), configJSON},
		{blob(digestOf(manifestJSON)), manifestJSON},
	} {
		if err := add(e.name, e.data); err != nil {
			f.Close()
			return err
		}
	}
	layer, err := os.Open(layerPath)
	if err != nil {
		f.Close()
		return err
	}
	defer layer.Close()
	if err := tw.WriteHeader(&tar.Header{Name: blob(layerDigest), Mode: 0o644, Size: layerSize, Typeflag: tar.TypeReg}); err != nil {
		f.Close()
		return err
	}
	if _, err := io.Copy(tw, layer); err != nil {
		f.Close()
		return err
	}
	if err := tw.Close(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, out)
}

// writeLayer writes the layer tar (directories implied by the paths, the
// files with their mode, the links), in a fixed order with fixed times so
// the same inputs make the same digest; returns its digest and size.
func writeLayer(at string, spec imageSpec) (string, int64, error) {
	f, err := os.Create(at)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	h := sha256.New()
	counted := &countingWriter{w: io.MultiWriter(f, h)}
	tw := tar.NewWriter(counted)
	epoch := time.Unix(0, 0)
	dirs := map[string]bool{}
	var paths []string
	for p := range spec.Files {
		paths = append(paths, p)
	}
	for p := range spec.Links {
		paths = append(paths, p)
	}
	for _, p := range paths {
		for d := path.Dir(p); d != "/" && d != "."; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	var dirList []string
	for d := range dirs {
		dirList = append(dirList, d)
	}
	sort.Strings(dirList)
	for _, d := range dirList {
		hdr := &tar.Header{Name: strings.TrimPrefix(d, "/") + "/", Mode: 0o755, Typeflag: tar.TypeDir, ModTime: epoch}
		if err := tw.WriteHeader(hdr); err != nil {
			return "", 0, err
		}
	}
	sort.Strings(paths)
	for _, p := range paths {
		name := strings.TrimPrefix(p, "/")
		if target, ok := spec.Links[p]; ok {
			hdr := &tar.Header{Name: name, Linkname: target, Mode: 0o777, Typeflag: tar.TypeSymlink, ModTime: epoch}
			if err := tw.WriteHeader(hdr); err != nil {
				return "", 0, err
			}
			continue
		}
		src := spec.Files[p]
		st, err := os.Stat(src)
		if err != nil {
			return "", 0, err
		}
		if !st.Mode().IsRegular() {
			return "", 0, fmt.Errorf("%s: not a regular file", src)
		}
		hdr := &tar.Header{Name: name, Mode: int64(st.Mode().Perm()), Size: st.Size(), Typeflag: tar.TypeReg, ModTime: epoch}
		if err := tw.WriteHeader(hdr); err != nil {
			return "", 0, err
		}
		in, err := os.Open(src)
		if err != nil {
			return "", 0, err
		}
		_, err = io.Copy(tw, in)
		in.Close()
		if err != nil {
			return "", 0, fmt.Errorf("%s: %w", src, err)
		}
	}
	if err := tw.Close(); err != nil {
		return "", 0, err
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), counted.n, nil
}

type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

func digestOf(data []byte) string {
	sum := sha256.Sum256(data)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// refName is the tag of a name ("ghcr.io/a/b:0.1.0" -> "0.1.0"), "latest"
// without one.
func refName(name string) string {
	slash := strings.LastIndex(name, "/")
	if colon := strings.LastIndex(name, ":"); colon > slash {
		return name[colon+1:]
	}
	return "latest"
}
