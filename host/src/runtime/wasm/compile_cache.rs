//! The on-disk cache of compiled components: a restart (or a second server on the same
//! machine) loads a stage's native code instead of recompiling it, which takes seconds for
//! Python and JavaScript stages.
//!
//! Entries are named by the engine's compatibility hash and the component's bytes, so every
//! rebuilt stage and every wasmtime upgrade adds one (a componentize-py stage is ~36 MB). The
//! cache is therefore kept under a size bound: after each store the least recently used
//! entries (by modification time, which a hit renews) are removed until the total fits. The
//! entry just written is always kept.

use std::{
    hash::{Hash, Hasher},
    io,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use sha2::{Digest, Sha256};
use wasmtime::{component::Component, Engine};

use crate::private_dir;

/// The size the cache is kept under when none is configured.
pub const DEFAULT_MAX_BYTES: u64 = 2 << 30;

/// Temporary files of a store that never finished (a killed server) are removed once older
/// than this; a store in progress is far younger.
const ABANDONED_AFTER: Duration = Duration::from_secs(3600);

const SUFFIX: &str = ".cwasm";
const TEMP_PREFIX: &str = ".cwasm-";

/// A cache directory (checked to be this user's alone) and the size it is kept under.
#[derive(Debug, Clone)]
pub struct CompileCache {
    dir: PathBuf,
    max_bytes: u64,
}

impl CompileCache {
    /// The cache in `dir`, or `None` when `dir` cannot be made private to this user (someone
    /// else could write native code there: the caller compiles instead).
    pub fn open(dir: &Path, max_bytes: u64) -> Option<Self> {
        match private_dir::ensure_private(dir) {
            Ok(()) => Some(Self {
                dir: dir.to_path_buf(),
                max_bytes,
            }),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "not using the compiled-stage cache");
                None
            }
        }
    }

    /// Where the compiled form of `wasm` for `engine` is kept.
    pub fn entry(&self, engine: &Engine, wasm: &[u8]) -> PathBuf {
        self.dir.join(format!("{}{SUFFIX}", key(engine, wasm)))
    }

    /// The compiled component at `path`, if there is a usable one; a hit marks it as recently
    /// used.
    pub fn load(&self, engine: &Engine, path: &Path) -> Option<Component> {
        let mut file = match private_dir::open_owned_file(path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "ignoring a compiled component");
                return None;
            }
        };
        let mut bytes = Vec::new();
        io::Read::read_to_end(&mut file, &mut bytes).ok()?;
        // SAFETY: the file was written by `Component::serialize` of an engine with the same
        // compatibility hash (it is in the file name), in a directory checked to be this
        // user's alone, and opened without following links.
        match unsafe { Component::deserialize(engine, &bytes) } {
            Ok(component) => {
                // Best effort: an entry that keeps its old time is merely evicted sooner.
                let _ = file.set_modified(SystemTime::now());
                Some(component)
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "ignoring unusable compiled component");
                None
            }
        }
    }

    /// Writes `component` to `path`, then removes the least recently used entries until the
    /// cache fits its bound again.
    pub fn store(&self, component: &Component, path: &Path) -> io::Result<()> {
        let bytes = component.serialize().map_err(io::Error::other)?;
        // A new file with a random name (never a link someone planted), then renamed into
        // place so that a concurrent reader never sees half a file.
        let mut tmp = tempfile::Builder::new()
            .prefix(TEMP_PREFIX)
            .tempfile_in(&self.dir)?;
        io::Write::write_all(&mut tmp, &bytes)?;
        tmp.persist(path).map_err(|e| e.error)?;
        let removed = prune(&self.dir, self.max_bytes, path)?;
        if removed > 0 {
            tracing::info!(
                dir = %self.dir.display(),
                removed,
                max_mb = self.max_bytes >> 20,
                "removed least recently used compiled stages"
            );
        }
        Ok(())
    }
}

/// Cache key: the engine's compatibility hash (wasmtime version and configuration) and the
/// component bytes.
fn key(engine: &Engine, wasm: &[u8]) -> String {
    let mut engine_hash = std::collections::hash_map::DefaultHasher::new();
    engine
        .precompile_compatibility_hash()
        .hash(&mut engine_hash);
    let mut sha = Sha256::new();
    sha.update(engine_hash.finish().to_le_bytes());
    sha.update(wasm);
    sha.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Removes the oldest entries of `dir` until they total at most `max_bytes` (never `keep`),
/// and temporary files abandoned by an interrupted store. Only regular files with the cache's
/// names are touched: nothing else in the directory, and no link is followed. Returns how many
/// entries were removed.
fn prune(dir: &Path, max_bytes: u64, keep: &Path) -> io::Result<usize> {
    let now = SystemTime::now();
    let mut entries = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        // `DirEntry::metadata` does not follow links.
        let Ok(meta) = entry.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        let modified = meta.modified().unwrap_or(now);
        if name.starts_with(TEMP_PREFIX) {
            if now.duration_since(modified).unwrap_or_default() > ABANDONED_AFTER {
                remove(&entry.path());
            }
        } else if name.ends_with(SUFFIX) && !name.starts_with('.') {
            entries.push((modified, meta.len(), entry.path()));
        }
    }
    let mut total: u64 = entries.iter().map(|(_, len, _)| len).sum();
    entries.sort_by_key(|(modified, _, _)| *modified);
    let mut removed = 0;
    for (_, len, path) in entries {
        if total <= max_bytes {
            break;
        }
        if path == keep {
            continue;
        }
        remove(&path);
        total = total.saturating_sub(len);
        removed += 1;
    }
    Ok(removed)
}

/// Removes a cache file; another server sharing the cache may have removed it first.
fn remove(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != io::ErrorKind::NotFound {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove a cached compiled stage");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;

    fn entry(dir: &Path, name: &str, len: usize, age_secs: u64) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, vec![0u8; len]).unwrap();
        let when = SystemTime::now() - Duration::from_secs(age_secs);
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(when)
            .unwrap();
        path
    }

    #[test]
    fn the_least_recently_used_entries_go_first_and_the_new_one_stays() {
        let dir = tempfile::tempdir().unwrap();
        let oldest = entry(dir.path(), "a.cwasm", 400, 300);
        let older = entry(dir.path(), "b.cwasm", 400, 200);
        let recent = entry(dir.path(), "c.cwasm", 400, 100);
        let new = entry(dir.path(), "d.cwasm", 400, 0);
        assert_eq!(prune(dir.path(), 1000, &new).unwrap(), 2);
        assert!(!oldest.exists() && !older.exists());
        assert!(recent.exists() && new.exists());
        // A new entry larger than the bound stays, alone.
        assert_eq!(prune(dir.path(), 100, &new).unwrap(), 1);
        assert!(!recent.exists() && new.exists());
    }

    #[test]
    fn pruning_touches_only_the_caches_own_files() {
        let dir = tempfile::tempdir().unwrap();
        let other = entry(dir.path(), "notes.txt", 4000, 900);
        let stale_tmp = entry(dir.path(), ".cwasm-abc", 10, 7200);
        let live_tmp = entry(dir.path(), ".cwasm-def", 10, 1);
        let outside = tempfile::tempdir().unwrap();
        let victim = entry(outside.path(), "victim.cwasm", 4000, 900);
        std::os::unix::fs::symlink(&victim, dir.path().join("link.cwasm")).unwrap();
        let new = entry(dir.path(), "new.cwasm", 10, 0);
        assert_eq!(prune(dir.path(), 0, &new).unwrap(), 0);
        assert!(other.exists() && live_tmp.exists() && new.exists());
        assert!(!stale_tmp.exists());
        assert!(victim.exists() && dir.path().join("link.cwasm").exists());
    }
}
