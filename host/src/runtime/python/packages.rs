//! A Python model's own packages, as Triton's `EXECUTION_ENV_PATH` gives them: a packed
//! environment (`conda-pack`'s `.tar.gz`, or a `.tgz` / `.tar`) or an unpacked one (a
//! folder), inside the model's folder (`$$TRITON_MODEL_DIRECTORY/env.tar.gz`). Only its
//! `lib/python*/site-packages` is used: an archive's are read entry by entry into a private
//! folder the server owns (regular files only: no links, no path out of it, bounded in size
//! and count), removed with the model. The guest sees the folder read-only and puts it on
//! `sys.path` after the sandbox's own packages, which win (numpy, Pillow, … are the
//! sandbox's); a package only the environment has that holds a native extension module is
//! refused at load, naming the module and its file (`guest/backend.py`).

use std::{
    io::Read,
    path::{Component, Path, PathBuf},
};

use crate::{
    error::{Error, Result},
    names::ModelFilePath,
    private_dir::ScratchDir,
    proto::inference::ModelConfig,
};

/// The configuration parameter (Triton's).
pub const PARAMETER: &str = "EXECUTION_ENV_PATH";

/// The most an environment's packages may hold once unpacked.
const MAX_BYTES: u64 = 2 << 30;
/// The same for an environment that came with a load request (a small archive may unpack to
/// much more than its request's size).
const MAX_BYTES_SENT: u64 = 256 << 20;
/// The most files they may be.
const MAX_FILES: usize = 200_000;

/// A model's packages, ready to mount.
#[derive(Debug)]
pub(super) struct Packages {
    /// The folder the guest puts on its `sys.path`.
    pub folder: PathBuf,
    /// Where an archive was unpacked (removed with the model).
    _unpacked: Option<ScratchDir>,
}

/// The model's packages when its configuration names an environment; an error names the
/// parameter and what is wrong with it. One that came with a load request (`sent`) may
/// unpack to less.
pub(super) fn of(config: &ModelConfig, model_dir: &Path, sent: bool) -> Result<Option<Packages>> {
    let Some(value) = config.parameters.get(PARAMETER) else {
        return Ok(None);
    };
    let name = &config.name;
    let bad = |why: String| {
        Error::invalid(format!(
            "model '{name}': parameter '{PARAMETER}' (\"{}\"): {why}",
            value.string_value
        ))
    };
    let path = inside(model_dir, &value.string_value).map_err(bad)?;
    if path.is_dir() {
        let folder = site_packages(&path).unwrap_or(path);
        return Ok(Some(Packages {
            folder,
            _unpacked: None,
        }));
    }
    let text = path.to_string_lossy();
    let gzip = text.ends_with(".tar.gz") || text.ends_with(".tgz");
    if !gzip && !text.ends_with(".tar") {
        return Err(bad(
            "not a folder, nor a .tar.gz, .tgz or .tar archive (conda-pack's)".into(),
        ));
    }
    let file = std::fs::File::open(&path).map_err(|e| bad(format!("cannot read it: {e}")))?;
    let reader: Box<dyn Read> = if gzip {
        Box::new(flate2::read::GzDecoder::new(std::io::BufReader::new(file)))
    } else {
        Box::new(std::io::BufReader::new(file))
    };
    let unpacked = ScratchDir::new("wasmtron-python-env-")
        .map_err(|e| bad(format!("cannot make a folder to unpack it in: {e}")))?;
    let max_bytes = if sent { MAX_BYTES_SENT } else { MAX_BYTES };
    let files = unpack_site_packages(reader, &unpacked, max_bytes).map_err(bad)?;
    tracing::info!(model = %name, files, "packages of {PARAMETER} unpacked");
    Ok(Some(Packages {
        folder: unpacked.path().join("site-packages"),
        _unpacked: Some(unpacked),
    }))
}

/// `value` (Triton's `$$TRITON_MODEL_DIRECTORY` standing for the model's folder, a relative
/// path taken from there) as a path that is inside the model's folder.
fn inside(model_dir: &Path, value: &str) -> std::result::Result<PathBuf, String> {
    let value = value.trim();
    let relative = value
        .strip_prefix("$$TRITON_MODEL_DIRECTORY")
        .or_else(|| value.strip_prefix("$TRITON_MODEL_DIRECTORY"))
        .map(|rest| rest.trim_start_matches('/'))
        .unwrap_or(value);
    let outside = || {
        "it must be inside the model's folder (write it as $$TRITON_MODEL_DIRECTORY/…, of \
         plain parts): the server reads no files from elsewhere for a model"
            .to_owned()
    };
    // The one check of paths in a model's folder (as a load request's `file:` keys), then
    // the real path, so that a link inside the folder cannot lead out of it either.
    let file = ModelFilePath::parse(relative).map_err(|_| outside())?;
    let joined = model_dir.join(file.to_path());
    let (Ok(real), Ok(root)) = (joined.canonicalize(), model_dir.canonicalize()) else {
        return Err(format!("'{}' does not exist", joined.display()));
    };
    if !real.starts_with(&root) {
        return Err(outside());
    }
    Ok(real)
}

/// `lib/python*/site-packages` of an unpacked environment, if it has one.
fn site_packages(env: &Path) -> Option<PathBuf> {
    let lib = std::fs::read_dir(env.join("lib")).ok()?;
    let mut found: Vec<PathBuf> = lib
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("python"))
        .map(|e| e.path().join("site-packages"))
        .filter(|p| p.is_dir())
        .collect();
    found.sort();
    found.pop()
}

/// The `site-packages` part of a `lib/python*/site-packages/…` path: its plain components.
fn in_site_packages(path: &Path) -> Option<Vec<String>> {
    let mut parts = Vec::new();
    for c in path.components() {
        match c {
            Component::Normal(p) => parts.push(p.to_str()?.to_owned()),
            Component::CurDir => {}
            _ => return None,
        }
    }
    match parts.as_slice() {
        [lib, python, site, rest @ ..]
            if lib == "lib"
                && python.starts_with("python")
                && site == "site-packages"
                && !rest.is_empty() =>
        {
            Some(rest.to_vec())
        }
        _ => None,
    }
}

/// Writes the regular files under `lib/python*/site-packages/` of the archive into
/// `into/site-packages/`; the number of files, or what is wrong.
fn unpack_site_packages(
    reader: impl Read,
    into: &ScratchDir,
    max_bytes: u64,
) -> std::result::Result<usize, String> {
    let mut archive = tar::Archive::new(reader);
    let entries = archive
        .entries()
        .map_err(|e| format!("not a tar archive: {e}"))?;
    let (mut files, mut bytes) = (0usize, 0u64);
    for entry in entries {
        let mut entry = entry.map_err(|e| format!("a damaged archive: {e}"))?;
        if !entry.header().entry_type().is_file() {
            continue; // folders are made as files need them; links are never followed
        }
        let path = entry
            .path()
            .map_err(|e| format!("an entry with an unreadable name: {e}"))?
            .into_owned();
        let Some(rest) = in_site_packages(&path) else {
            continue;
        };
        files += 1;
        bytes = bytes.saturating_add(entry.size());
        if files > MAX_FILES || bytes > max_bytes {
            return Err(format!(
                "its packages hold more than {MAX_FILES} files or {} MiB",
                max_bytes >> 20
            ));
        }
        let mut content = Vec::with_capacity(entry.size() as usize);
        entry
            .read_to_end(&mut content)
            .map_err(|e| format!("cannot read '{}': {e}", path.display()))?;
        let mut relative = vec!["site-packages".to_owned()];
        relative.extend(rest);
        into.write_new(&relative, &content)
            .map_err(|e| format!("cannot unpack '{}': {e}", path.display()))?;
    }
    if files == 0 {
        return Err("it has no lib/python*/site-packages (is it conda-pack's archive?)".into());
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archive(entries: &[(&str, &[u8])]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for (path, content) in entries {
            let mut header = tar::Header::new_gnu();
            header.set_size(content.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            builder.append_data(&mut header, path, *content).unwrap();
        }
        builder.into_inner().unwrap()
    }

    #[test]
    fn only_site_packages_files_are_unpacked() {
        let tar = archive(&[
            ("bin/python", b"native"),
            ("lib/python3.10/site-packages/pkg/__init__.py", b"X = 1\n"),
            ("lib/python3.10/site-packages/top.py", b"Y = 2\n"),
            ("lib/libz.so", b"native"),
        ]);
        let dir = ScratchDir::new("packages-test-").unwrap();
        assert_eq!(unpack_site_packages(&tar[..], &dir, MAX_BYTES).unwrap(), 2);
        let site = dir.path().join("site-packages");
        assert_eq!(
            std::fs::read_to_string(site.join("pkg/__init__.py")).unwrap(),
            "X = 1\n"
        );
        assert!(site.join("top.py").is_file());
        assert!(!dir.path().join("bin").exists() && !dir.path().join("lib").exists());
        // Past the bound (a sent environment's is smaller): refused, naming it.
        let dir = ScratchDir::new("packages-test-").unwrap();
        let e = unpack_site_packages(&tar[..], &dir, 4).unwrap_err();
        assert!(e.contains("more than") && e.contains("MiB"), "{e}");
    }

    #[test]
    fn paths_out_of_site_packages_are_never_written() {
        for path in [
            "lib/python3.10/site-packages/../../../escape.py",
            "/lib/python3.10/site-packages/abs.py",
            "lib/python3.10/other/x.py",
        ] {
            assert_eq!(in_site_packages(Path::new(path)), None, "{path}");
        }
        let dir = ScratchDir::new("packages-test-").unwrap();
        let e = unpack_site_packages(&archive(&[("bin/python", b"x")])[..], &dir, MAX_BYTES)
            .unwrap_err();
        assert!(e.contains("no lib/python*/site-packages"), "{e}");
    }

    #[test]
    fn the_environment_must_be_in_the_models_folder() {
        let root = tempfile::tempdir().unwrap();
        let model = root.path().join("m");
        std::fs::create_dir_all(model.join("env")).unwrap();
        std::fs::write(root.path().join("outside.tar.gz"), b"").unwrap();
        assert_eq!(
            inside(&model, "$$TRITON_MODEL_DIRECTORY/env").unwrap(),
            model.join("env").canonicalize().unwrap()
        );
        assert!(inside(&model, "env").is_ok());
        let e = inside(&model, "$$TRITON_MODEL_DIRECTORY/../outside.tar.gz").unwrap_err();
        assert!(e.contains("inside the model's folder"), "{e}");
        let outside = root.path().join("outside.tar.gz");
        assert!(inside(&model, outside.to_str().unwrap()).is_err());
        assert!(inside(&model, "missing.tar.gz")
            .unwrap_err()
            .contains("does not exist"));
    }
}
