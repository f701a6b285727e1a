//! Directories the server owns. Another local user is an attacker too: a directory whose
//! contents the server trusts (compiled stages it runs, model files it stages) is made with mode
//! 0700 and checked before use (a real directory, not a link, owned by this user, writable by
//! nobody else); files in it are opened without following links. Scratch directories get a
//! random name created atomically, so nobody can make them first.

use std::{
    fs::{File, OpenOptions},
    io,
    os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt},
    path::{Path, PathBuf},
};

/// The effective user id of this process.
fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Makes `dir` (and missing parents) with mode 0700 when it does not exist, then checks that
/// it is a directory of this user that no one else may write: the check an attacker's
/// directory (or a link planted where the server will look) fails.
pub fn ensure_private(dir: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    check_private(dir)
}

/// Checks that `dir` is a directory owned by this user, not a link, with no group or other
/// write permission.
pub fn check_private(dir: &Path) -> io::Result<()> {
    let meta = std::fs::symlink_metadata(dir)?;
    let refuse = |why: String| {
        io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("'{}' is not a private directory: {why}", dir.display()),
        )
    };
    if meta.file_type().is_symlink() {
        return Err(refuse("it is a symbolic link".into()));
    }
    if !meta.is_dir() {
        return Err(refuse("it is not a directory".into()));
    }
    if meta.uid() != euid() {
        return Err(refuse(format!(
            "it belongs to user {} (the server runs as {})",
            meta.uid(),
            euid()
        )));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(refuse(format!(
            "its mode {:o} lets others write in it",
            meta.mode() & 0o7777
        )));
    }
    Ok(())
}

/// [`check_private`] on a directory already open (`path` names it in errors): the check holds
/// for the directory the descriptor refers to, whatever happens to the path afterwards.
pub fn check_private_fd(fd: &impl std::os::fd::AsFd, path: &Path) -> io::Result<()> {
    let stat = rustix::fs::fstat(fd)?;
    let refuse = |why: String| {
        io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("'{}' is not a private directory: {why}", path.display()),
        )
    };
    if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::Directory {
        return Err(refuse("it is not a directory".into()));
    }
    if stat.st_uid != euid() {
        return Err(refuse(format!(
            "it belongs to user {} (the server runs as {})",
            stat.st_uid,
            euid()
        )));
    }
    if stat.st_mode & 0o022 != 0 {
        return Err(refuse(format!(
            "its mode {:o} lets others write in it",
            stat.st_mode & 0o7777
        )));
    }
    Ok(())
}

/// Opens an existing regular file for reading without following a link at its last component,
/// and checks that this user owns it.
pub fn open_owned_file(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() || meta.uid() != euid() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("'{}' is not a regular file of this user", path.display()),
        ));
    }
    Ok(file)
}

/// Creates a new file (failing if anything, a link included, is already at `path`).
pub fn create_new_file(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// A scratch directory with a random name made atomically with mode 0700 (in `$TMPDIR` or
/// `/tmp`); removed, with what the server wrote in it, when dropped.
#[derive(Debug)]
pub struct ScratchDir {
    dir: tempfile::TempDir,
}

impl ScratchDir {
    /// A new, empty scratch directory whose name starts with `prefix`.
    pub fn new(prefix: &str) -> io::Result<Self> {
        Self::new_in(&std::env::temp_dir(), prefix)
    }

    /// A new, empty scratch directory in `parent` whose name starts with `prefix`.
    pub fn new_in(parent: &Path, prefix: &str) -> io::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .tempdir_in(parent)?;
        check_private(dir.path())?;
        Ok(Self { dir })
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Keeps the directory (it is no longer removed when dropped) and gives its path: to
    /// publish a finished directory by renaming it.
    pub fn keep(self) -> PathBuf {
        self.dir.keep()
    }

    /// Writes `content` as the new file `relative` (made of plain components, checked by the
    /// caller), creating the folders on the way inside this directory.
    pub fn write_new(&self, relative: &[String], content: &[u8]) -> io::Result<PathBuf> {
        let mut path = self.dir.path().to_path_buf();
        let Some((file, folders)) = relative.split_last() else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty path"));
        };
        for folder in folders {
            path.push(folder);
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => {}
                // Made by an earlier file of the same load: still check it is our folder.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => check_private(&path)?,
                Err(e) => return Err(e),
            }
        }
        path.push(file);
        io::Write::write_all(&mut create_new_file(&path)?, content)?;
        Ok(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_directories_refuse_links_and_open_modes() {
        let scratch = ScratchDir::new("wasmtron-test-").unwrap();
        let mode = std::fs::metadata(scratch.path()).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o700);
        let open = scratch.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .unwrap();
        assert!(ensure_private(&open)
            .unwrap_err()
            .to_string()
            .contains("lets others write"));
        let link = scratch.path().join("link");
        std::os::unix::fs::symlink(&open, &link).unwrap();
        assert!(check_private(&link)
            .unwrap_err()
            .to_string()
            .contains("symbolic link"));
        let fresh = scratch.path().join("a/b");
        ensure_private(&fresh).unwrap();
        assert_eq!(std::fs::metadata(&fresh).unwrap().mode() & 0o777, 0o700);
    }

    #[test]
    fn scratch_files_are_new_files_never_followed_links() {
        let scratch = ScratchDir::new("wasmtron-test-").unwrap();
        let path = scratch
            .write_new(&["1".into(), "model.onnx".into()], b"abc")
            .unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"abc");
        // A second file with the same name is refused rather than overwritten.
        assert!(scratch
            .write_new(&["1".into(), "model.onnx".into()], b"x")
            .is_err());
        let victim = scratch.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        std::os::unix::fs::symlink(&victim, scratch.path().join("1/link")).unwrap();
        assert!(scratch
            .write_new(&["1".into(), "link".into()], b"x")
            .is_err());
        assert!(open_owned_file(&scratch.path().join("1/link")).is_err());
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        let dir = scratch.path().to_path_buf();
        drop(scratch);
        assert!(!dir.exists());
    }
}
