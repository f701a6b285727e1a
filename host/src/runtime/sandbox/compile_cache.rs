//! The on-disk cache of compiled components: a restart (or a second server on the same
//! machine) loads a stage's native code instead of recompiling it, which takes seconds for
//! Python and JavaScript stages.
//!
//! Entries are named by the engine's compatibility hash and the component's bytes, so every
//! rebuilt stage and every wasmtime upgrade adds one (a componentize-py stage is ~36 MB). The
//! cache is therefore kept under a size bound: after each store the least recently used
//! entries (by modification time, which a hit renews) are removed until the total fits. The
//! entry just written is always kept.
//!
//! The cache holds native code the server runs, so another local user must not be able to
//! steer it. Its directory is opened once per process (`O_DIRECTORY | O_NOFOLLOW`) and checked
//! on the open descriptor (a directory of this user that nobody else may write; its parent not
//! writable by others unless sticky); every later read, write, rename and removal is relative
//! to that descriptor (`openat`, `renameat`, `unlinkat`) and never follows a link, so swapping
//! the path for a link after the check — while a stage compiles for seconds — changes nothing.

use std::{
    collections::HashMap,
    ffi::OsStr,
    hash::{Hash, Hasher},
    io::{self, Read, Write},
    os::{fd::OwnedFd, unix::ffi::OsStrExt},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, SystemTime},
};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use sha2::{Digest, Sha256};
use wasmtime::{component::Component, Engine, Module};

use crate::private_dir;

/// The size the cache is kept under when none is configured.
pub const DEFAULT_MAX_BYTES: u64 = 2 << 30;

/// Temporary files of a store that never finished (a killed server) are removed once older
/// than this; a store in progress is far younger.
const ABANDONED_AFTER: Duration = Duration::from_secs(3600);

const SUFFIX: &str = ".cwasm";
const TEMP_PREFIX: &str = ".cwasm-";

/// A cache directory, open and checked to be this user's alone, and the size it is kept under.
#[derive(Debug)]
pub struct CompileCache {
    dir: OwnedFd,
    /// The path it was opened at, for messages only.
    shown: PathBuf,
    max_bytes: u64,
    /// Held from an entry's rename to the end of the pruning after it: stages compiled at
    /// once (models load in parallel) would otherwise each prune the other's new entry.
    storing: Mutex<()>,
}

/// An entry's file name in the cache directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry(String);

impl Entry {
    /// The file name.
    pub fn name(&self) -> &str {
        &self.0
    }
}

impl CompileCache {
    /// The cache in `dir` (made private when missing), opened once per process and shared; or
    /// `None` when it is not a private directory of this user (someone else could write native
    /// code there: the caller compiles instead, and the reason is logged once).
    pub fn open(dir: &Path, max_bytes: u64) -> Option<Arc<Self>> {
        type Opened = HashMap<(PathBuf, u64), Option<Arc<CompileCache>>>;
        static OPENED: Mutex<Option<Opened>> = Mutex::new(None);
        let mut opened = OPENED.lock().unwrap_or_else(PoisonError::into_inner);
        opened
            .get_or_insert_with(HashMap::new)
            .entry((dir.to_path_buf(), max_bytes))
            .or_insert_with(|| match Self::open_checked(dir, max_bytes) {
                Ok(cache) => Some(Arc::new(cache)),
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "not using the compiled-stage cache");
                    None
                }
            })
            .clone()
    }

    /// Opens `dir` and checks it on its descriptor; refuses a parent that others may write
    /// without the sticky bit (they could swap the directory before it is opened).
    pub fn open_checked(dir: &Path, max_bytes: u64) -> io::Result<Self> {
        private_dir::ensure_private(dir)?;
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            let meta = std::fs::metadata(parent)?;
            let mode = std::os::unix::fs::PermissionsExt::mode(&meta.permissions());
            if mode & 0o022 != 0 && mode & 0o1000 == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "its parent '{}' (mode {:o}) lets others write in it without the sticky bit",
                        parent.display(),
                        mode & 0o7777
                    ),
                ));
            }
        }
        let fd = rustix::fs::open(
            dir,
            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        private_dir::check_private_fd(&fd, dir)?;
        Ok(Self {
            dir: fd,
            shown: dir.to_path_buf(),
            max_bytes,
            storing: Mutex::new(()),
        })
    }

    /// Where the compiled form of `wasm` for `engine` is kept.
    pub fn entry(&self, engine: &Engine, wasm: &[u8]) -> Entry {
        Entry(format!("{}{SUFFIX}", key(engine, wasm)))
    }

    /// The path of an entry, for messages.
    pub fn shown(&self, entry: &Entry) -> PathBuf {
        self.shown.join(&entry.0)
    }

    /// The compiled component of `entry`, if there is a usable one; a hit marks it as
    /// recently used.
    pub fn load(&self, engine: &Engine, entry: &Entry) -> Option<Component> {
        self.load_with(entry, |file| {
            let mut bytes = Vec::new();
            file.read_to_end(&mut bytes)
                .map_err(wasmtime::Error::from)?;
            // SAFETY: the file was written by `Component::serialize` of an engine with the
            // same compatibility hash (it is in the file name), in a directory checked to be
            // this user's alone, and opened relative to it without following links.
            unsafe { Component::deserialize(engine, &bytes) }
        })
    }

    /// The compiled core module of `entry` (the Python backend's interpreter), mapped from
    /// the file rather than read: the interpreter's native code is hundreds of megabytes.
    pub fn load_module(&self, engine: &Engine, entry: &Entry) -> Option<Module> {
        self.load_with(entry, |file| {
            // SAFETY: as in `load`, written by `Module::serialize` of an engine with the same
            // compatibility hash; entries are replaced by rename, never written in place, so
            // the mapped file does not change under the module.
            unsafe { Module::deserialize_open_file(engine, file.try_clone()?) }
        })
    }

    fn load_with<T>(
        &self,
        entry: &Entry,
        read: impl FnOnce(&mut std::fs::File) -> wasmtime::Result<T>,
    ) -> Option<T> {
        let mut file = match self.open_owned(&entry.0) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(path = %self.shown(entry).display(), error = %e, "ignoring a compiled component");
                return None;
            }
        };
        match read(&mut file) {
            Ok(loaded) => {
                // Best effort: an entry that keeps its old time is merely evicted sooner.
                let _ = file.set_modified(SystemTime::now());
                Some(loaded)
            }
            Err(e) => {
                tracing::warn!(path = %self.shown(entry).display(), error = %e, "ignoring unusable compiled component");
                None
            }
        }
    }

    /// Opens an entry for reading without following a link, if it is a regular file of this
    /// user.
    fn open_owned(&self, name: &str) -> io::Result<std::fs::File> {
        let fd = rustix::fs::openat(
            &self.dir,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let stat = rustix::fs::fstat(&fd)?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile
            || stat.st_uid != rustix::process::geteuid().as_raw()
        {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("'{name}' is not a regular file of this user"),
            ));
        }
        Ok(std::fs::File::from(fd))
    }

    /// Writes `component` as `entry`, then removes the least recently used entries until the
    /// cache fits its bound again.
    pub fn store(&self, component: &Component, entry: &Entry) -> io::Result<()> {
        self.store_bytes(&component.serialize().map_err(io::Error::other)?, entry)
    }

    /// Writes a compiled core module as `entry`, as [`store`](Self::store) does a component.
    pub fn store_module(&self, module: &Module, entry: &Entry) -> io::Result<()> {
        self.store_bytes(&module.serialize().map_err(io::Error::other)?, entry)
    }

    fn store_bytes(&self, bytes: &[u8], entry: &Entry) -> io::Result<()> {
        // A new file with a random name (never a link someone planted), then renamed into
        // place so that a concurrent reader never sees half a file.
        let tmp = format!("{TEMP_PREFIX}{:016x}", random_u64());
        let fd = rustix::fs::openat(
            &self.dir,
            tmp.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )?;
        let written = std::fs::File::from(fd).write_all(bytes);
        let _storing = self.storing.lock().unwrap_or_else(PoisonError::into_inner);
        if let Err(e) = written.and_then(|()| {
            rustix::fs::renameat(&self.dir, tmp.as_str(), &self.dir, entry.0.as_str())
                .map_err(io::Error::from)
        }) {
            let _ = rustix::fs::unlinkat(&self.dir, tmp.as_str(), AtFlags::empty());
            return Err(e);
        }
        let removed = prune(&self.dir, self.max_bytes, &entry.0)?;
        if removed > 0 {
            tracing::info!(
                dir = %self.shown.display(),
                removed,
                max_mb = self.max_bytes >> 20,
                "removed least recently used compiled stages"
            );
        }
        Ok(())
    }
}

/// A random number for temporary names (not secret: the file is created exclusively).
fn random_u64() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(SystemTime::now())
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

/// Removes the oldest entries of the directory `dir` until they total at most `max_bytes`
/// (never `keep`), and temporary files abandoned by an interrupted store. Only regular files
/// with the cache's names are touched: nothing else in the directory, and no link is followed.
/// Returns how many entries were removed.
fn prune(dir: &OwnedFd, max_bytes: u64, keep: &str) -> io::Result<usize> {
    let now = SystemTime::now();
    let mut entries = Vec::new();
    for entry in rustix::fs::Dir::read_from(dir)? {
        let entry = entry?;
        let name = OsStr::from_bytes(entry.file_name().to_bytes());
        let Some(name) = name.to_str() else { continue };
        let Ok(stat) = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) else {
            continue;
        };
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
            continue;
        }
        let modified =
            SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(stat.st_mtime).unwrap_or(0));
        let len = u64::try_from(stat.st_size).unwrap_or(0);
        if name.starts_with(TEMP_PREFIX) {
            if now.duration_since(modified).unwrap_or_default() > ABANDONED_AFTER {
                remove(dir, name);
            }
        } else if name.ends_with(SUFFIX) && !name.starts_with('.') {
            entries.push((modified, len, name.to_owned()));
        }
    }
    let mut total: u64 = entries.iter().map(|(_, len, _)| len).sum();
    entries.sort_by_key(|(modified, _, _)| *modified);
    let mut removed = 0;
    for (_, len, name) in entries {
        if total <= max_bytes {
            break;
        }
        if name == keep {
            continue;
        }
        remove(dir, &name);
        total = total.saturating_sub(len);
        removed += 1;
    }
    Ok(removed)
}

/// Removes a cache file; another server sharing the cache may have removed it first.
fn remove(dir: &OwnedFd, name: &str) {
    if let Err(e) = rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
        if e != rustix::io::Errno::NOENT {
            tracing::warn!(name, error = %e, "cannot remove a cached compiled stage");
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

    fn opened(dir: &Path) -> OwnedFd {
        rustix::fs::open(dir, OFlags::DIRECTORY | OFlags::RDONLY, Mode::empty()).unwrap()
    }

    #[test]
    fn the_least_recently_used_entries_go_first_and_the_new_one_stays() {
        let dir = tempfile::tempdir().unwrap();
        let fd = opened(dir.path());
        let oldest = entry(dir.path(), "a.cwasm", 400, 300);
        let older = entry(dir.path(), "b.cwasm", 400, 200);
        let recent = entry(dir.path(), "c.cwasm", 400, 100);
        let new = entry(dir.path(), "d.cwasm", 400, 0);
        assert_eq!(prune(&fd, 1000, "d.cwasm").unwrap(), 2);
        assert!(!oldest.exists() && !older.exists());
        assert!(recent.exists() && new.exists());
        // A new entry larger than the bound stays, alone.
        assert_eq!(prune(&fd, 100, "d.cwasm").unwrap(), 1);
        assert!(!recent.exists() && new.exists());
    }

    #[test]
    fn pruning_touches_only_the_caches_own_files() {
        let dir = tempfile::tempdir().unwrap();
        let fd = opened(dir.path());
        let other = entry(dir.path(), "notes.txt", 4000, 900);
        let stale_tmp = entry(dir.path(), ".cwasm-abc", 10, 7200);
        let live_tmp = entry(dir.path(), ".cwasm-def", 10, 1);
        let outside = tempfile::tempdir().unwrap();
        let victim = entry(outside.path(), "victim.cwasm", 4000, 900);
        std::os::unix::fs::symlink(&victim, dir.path().join("link.cwasm")).unwrap();
        let new = entry(dir.path(), "new.cwasm", 10, 0);
        assert_eq!(prune(&fd, 0, "new.cwasm").unwrap(), 0);
        assert!(other.exists() && live_tmp.exists() && new.exists());
        assert!(!stale_tmp.exists());
        assert!(victim.exists() && dir.path().join("link.cwasm").exists());
    }

    #[test]
    fn a_directory_swapped_for_a_link_after_opening_is_not_followed() {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("cache");
        let cache = CompileCache::open_checked(&dir, 0).unwrap();
        // Another user swaps the checked directory for a link to a victim's folder.
        let moved = base.path().join("moved");
        std::fs::rename(&dir, &moved).unwrap();
        let victim = tempfile::tempdir().unwrap();
        let precious = entry(victim.path(), "precious.cwasm", 100, 900);
        std::os::unix::fs::symlink(victim.path(), &dir).unwrap();
        // Reads, writes and pruning still act on the directory that was opened.
        let e = Entry("x.cwasm".into());
        assert!(cache.open_owned(e.name()).is_err());
        std::fs::write(moved.join("x.cwasm"), b"x").unwrap();
        assert!(cache.open_owned(e.name()).is_ok());
        assert_eq!(prune(&cache.dir, 0, "none").unwrap(), 1);
        assert!(precious.exists() && !moved.join("x.cwasm").exists());
    }

    #[test]
    fn a_cache_under_a_folder_others_may_write_is_refused_unless_sticky() {
        use std::os::unix::fs::PermissionsExt;
        let base = tempfile::tempdir().unwrap();
        let open = base.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = CompileCache::open_checked(&open.join("cache"), 0).unwrap_err();
        assert!(e.to_string().contains("without the sticky bit"), "{e}");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        CompileCache::open_checked(&open.join("cache"), 0).unwrap();
        // A link where the cache should be is refused.
        let link = base.path().join("link");
        std::os::unix::fs::symlink(open.join("cache"), &link).unwrap();
        assert!(CompileCache::open_checked(&link, 0).is_err());
    }
}
