//! The POSIX shared-memory objects behind system regions: which file a key names, the checks
//! Triton makes of a key, and opening the object without trusting what another local user may
//! have put under `/dev/shm`.

use std::{
    fs::{File, OpenOptions},
    os::unix::fs::{MetadataExt, OpenOptionsExt},
    path::PathBuf,
};

use super::SHM_DIR;
use crate::{
    error::{Error, Result},
    names::ShmKey,
};

/// The file behind a key: one name directly in `/dev/shm` (`/name` or `name`), as `shm_open`
/// accepts it; anything that could name another file is refused.
pub(super) fn shm_path(key: &str) -> Result<PathBuf> {
    Ok(PathBuf::from(SHM_DIR).join(ShmKey::parse(key)?.file_name()))
}

/// Triton's Python backend names its own shared memory with this prefix; clients may not.
const RESERVED_KEY_PREFIX: &str = "triton_python_backend_shm_region_";

/// Triton's checks of a key before anything is opened, in its words: not slashes alone, and
/// not (after its leading slashes) the reserved prefix.
pub(super) fn check_key(name: &str, key: &str) -> Result<()> {
    let bare = key.trim_start_matches('/');
    if bare.is_empty() {
        return Err(Error::invalid(format!(
            "cannot register shared memory region '{name}' - invalid shm key '{key}'"
        )));
    }
    if bare.starts_with(RESERVED_KEY_PREFIX) {
        return Err(Error::invalid(format!(
            "cannot register shared memory region '{name}' with key '{key}' as the key \
             contains the reserved prefix '{RESERVED_KEY_PREFIX}'"
        )));
    }
    Ok(())
}

/// Which file an object is (device and inode), to notice one replaced under the same key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ObjectId {
    dev: u64,
    ino: u64,
}

/// Opens the object behind `key` for reading and writing: never through a link (another user
/// may have planted one in the shared `/dev/shm`), never blocking (a FIFO), only a regular file
/// with one name (a hard link to another file is refused too). Returns it with which file it
/// is and its size.
pub(super) fn open_object(key: &str, name: &str) -> Result<(File, ObjectId, u64)> {
    let path = shm_path(key)?;
    let refuse = |why: String| {
        Error::invalid(format!(
            "cannot open shared memory key '{}' for region '{name}': {why}",
            key.escape_debug()
        ))
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => refuse("it is a symbolic link".into()),
            _ => refuse(e.to_string()),
        })?;
    let meta = file.metadata().map_err(|e| refuse(e.to_string()))?;
    if !meta.is_file() {
        return Err(refuse("it is not a regular shared memory object".into()));
    }
    if meta.nlink() != 1 {
        return Err(refuse(format!(
            "it has {} names (a hard link to another file?)",
            meta.nlink()
        )));
    }
    let id = ObjectId {
        dev: meta.dev(),
        ino: meta.ino(),
    };
    Ok((file, id, meta.len()))
}
