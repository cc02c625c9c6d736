//! A Secret volume laid out as kubelet lays it out: `NAME -> ..data/NAME`,
//! `..data -> ..<version>`, and an update renames a new `..data` symlink over
//! the old one, then removes the old directory. What the webhook's
//! certificate reload sees in a Pod.

use std::fs;
use std::path::{Path, PathBuf};

pub struct SecretVolume {
    dir: PathBuf,
    version: u32,
}

impl SecretVolume {
    /// A volume in `dir` (which must exist) holding `files`.
    pub fn new(dir: &Path, files: &[(&str, &[u8])]) -> Self {
        let mut volume = Self {
            dir: dir.to_path_buf(),
            version: 0,
        };
        volume.publish(files);
        for (name, _) in files {
            std::os::unix::fs::symlink(Path::new("..data").join(name), dir.join(name)).unwrap();
        }
        volume
    }

    /// Replaces the contents at once, as kubelet's atomic writer does.
    pub fn publish(&mut self, files: &[(&str, &[u8])]) {
        let previous = format!("..2026_01_01_00_00_{:02}.{}", self.version, self.version);
        self.version += 1;
        let current = format!("..2026_01_01_00_00_{:02}.{}", self.version, self.version);
        let data = self.dir.join(&current);
        fs::create_dir(&data).unwrap();
        for (name, bytes) in files {
            fs::write(data.join(name), bytes).unwrap();
        }
        std::os::unix::fs::symlink(&current, self.dir.join("..data_tmp")).unwrap();
        fs::rename(self.dir.join("..data_tmp"), self.dir.join("..data")).unwrap();
        if self.version > 1 {
            fs::remove_dir_all(self.dir.join(previous)).unwrap();
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}
