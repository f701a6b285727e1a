//! What a model's files are, as one SHA-256: of a file, or of every file under a folder
//! (relative paths and contents, in path order). The converter's cache and the response cache
//! name what they keep by it, so that the same files give the same name on any server and
//! other files never do.

use std::{
    io::Read,
    path::{Path, PathBuf},
};

use sha2::{Digest, Sha256};

/// SHA-256 of a file, or of every regular file under a folder (links to files followed, as the
/// backends read them).
pub fn sha256_of(path: &Path) -> std::io::Result<[u8; 32]> {
    let mut h = Sha256::new();
    add(&mut h, path)?;
    Ok(h.finalize().into())
}

/// [`sha256_of`] in lower-case hex.
pub fn sha256_hex(path: &Path) -> std::io::Result<String> {
    Ok(hex(&sha256_of(path)?))
}

/// Adds what [`sha256_of`] hashes for `path` to a running hash.
pub fn add(h: &mut Sha256, path: &Path) -> std::io::Result<()> {
    if path.is_dir() {
        let mut files = Vec::new();
        collect_files(path, path, &mut files)?;
        files.sort();
        for relative in files {
            h.update(relative.to_string_lossy().as_bytes());
            h.update([0]);
            hash_file(&path.join(&relative), h)?;
        }
        Ok(())
    } else {
        hash_file(path, h)
    }
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn hash_file(path: &Path, h: &mut Sha256) -> std::io::Result<()> {
    let mut file = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        h.update(&buf[..n]);
    }
}

fn collect_files(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            collect_files(root, &entry.path(), out)?;
        } else if kind.is_file() {
            if let Ok(relative) = entry.path().strip_prefix(root) {
                out.push(relative.to_path_buf());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_hash_follows_names_and_contents() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("1")).unwrap();
        std::fs::write(dir.path().join("1/model.onnx"), b"a").unwrap();
        let first = sha256_of(dir.path()).unwrap();
        assert_eq!(first, sha256_of(dir.path()).unwrap());
        std::fs::write(dir.path().join("1/model.onnx"), b"b").unwrap();
        let second = sha256_of(dir.path()).unwrap();
        assert_ne!(first, second);
        std::fs::rename(dir.path().join("1"), dir.path().join("2")).unwrap();
        assert_ne!(second, sha256_of(dir.path()).unwrap());
    }
}
