package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// storage is the hypervisor's storage: one file per volume (or snapshot),
// named by its handle, in one directory. It is the ground truth the tests
// assert on: a file that outlives its tenant is a leaked volume.
//
// Files whose names begin with "." are not volumes: they are records being
// written (a record is written to a temporary file and then linked into
// place, so a reader never sees a half-written record).
type storage struct {
	dir string
	log *simLog
}

// volumeRecord is the JSON body of one ledger file.
type volumeRecord struct {
	Kind string `json:"kind"` // "volume" or "snapshot"
	// Layer is "management" for a disk of the management cluster's own
	// storage behind a tenant volume (the infra layer), "" for a disk the
	// tenant's driver holds directly.
	Layer           string `json:"layer,omitempty"`
	Handle          string `json:"volumeHandle"`
	TenantNamespace string `json:"tenantNamespace"`
	Tenant          string `json:"tenant"`
	PVC             string `json:"pvc"` // namespace/name of the claim (in the cluster of its layer)
	PVCUID          string `json:"pvcUID,omitempty"`
	PV              string `json:"pv,omitempty"`
	StorageClass    string `json:"storageClass,omitempty"`
	Capacity        string `json:"capacity"`
	DataVolume      string `json:"dataVolume,omitempty"`         // management layer: the DataVolume behind the tenant volume
	Snapshot        string `json:"snapshot,omitempty"`           // namespace/name of the VolumeSnapshot
	SourceHandle    string `json:"sourceVolumeHandle,omitempty"` // snapshots: the volume it was taken of
	Created         string `json:"created"`
}

func openStorage(dir string, log *simLog) (*storage, error) {
	dir = absPath(dir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("storage: %w", err)
	}
	return &storage{dir: dir, log: log}, nil
}

func (st *storage) path(handle string) (string, error) {
	if handle == "" || strings.ContainsAny(handle, `/\`) || strings.HasPrefix(handle, ".") {
		return "", fmt.Errorf("invalid volume handle %q", handle)
	}
	return filepath.Join(st.dir, handle), nil
}

// create records a volume. It is idempotent: an existing record is kept as
// it is (the first CreateVolume wins) and created reports false.
func (st *storage) create(rec volumeRecord) (created bool, err error) {
	path, err := st.path(rec.Handle)
	if err != nil {
		return false, err
	}
	if rec.Created == "" {
		rec.Created = time.Now().UTC().Format(time.RFC3339)
	}
	body, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return false, err
	}
	tmp, err := os.CreateTemp(st.dir, ".tmp-"+rec.Handle+"-")
	if err != nil {
		return false, err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(append(body, '\n')); err != nil {
		tmp.Close()
		return false, err
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return false, err
	}
	if err := tmp.Close(); err != nil {
		return false, err
	}
	// link(2) fails if the target exists: an atomic create-if-absent.
	if err := os.Link(tmp.Name(), path); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return false, nil
		}
		return false, err
	}
	return true, nil
}

// remove frees a volume; existed reports whether there was one to free.
func (st *storage) remove(handle string) (existed bool, err error) {
	path, err := st.path(handle)
	if err != nil {
		return false, err
	}
	err = os.Remove(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	return err == nil, err
}

// lookup reads a volume's record, if there is one.
func (st *storage) lookup(handle string) (volumeRecord, bool) {
	var rec volumeRecord
	path, err := st.path(handle)
	if err != nil {
		return rec, false
	}
	body, err := os.ReadFile(path)
	if err != nil || json.Unmarshal(body, &rec) != nil {
		return rec, false
	}
	return rec, true
}
