//! What a name that comes from a request may be. Every name the server later turns into a path
//! (a model name, a `file:` key of the load API, a shared-memory key) is parsed here once,
//! whichever frontend it came through, so that no request can name a file outside what the
//! server owns. A value of these types has passed the check; a bad one is refused with an
//! error that names the field and says what a good one looks like.

use std::{fmt, path::PathBuf};

use crate::error::{Error, Result};

/// Longest name, in bytes (one path component on Linux).
const MAX_NAME: usize = 255;
/// Most folders in a `file:` key (`1/model.onnx` has two parts).
const MAX_DEPTH: usize = 8;

/// Parses a version from a URL or message; empty means "let the policy choose". A version is
/// written in decimal digits with no sign and no leading zero (`+1` and `01` are refused, as
/// in Triton), so that one version has one spelling.
pub fn parse_version(model: &str, version: &str) -> Result<Option<i64>> {
    if version.is_empty() {
        return Ok(None);
    }
    let canonical = version.bytes().all(|b| b.is_ascii_digit())
        && (version == "0" || !version.starts_with('0'));
    version
        .parse::<i64>()
        .ok()
        .filter(|_| canonical)
        .map(Some)
        .ok_or_else(|| {
            Error::invalid(format!(
                "invalid version '{}' for model '{}': a version is a non-negative integer \
                 written in decimal digits (such as 1)",
                version.escape_debug(),
                model.escape_debug()
            ))
        })
}

/// Why `name` is not one plain path component, or `None` when it is.
fn component_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("it is empty")
    } else if name == "." || name == ".." {
        Some("'.' and '..' name other folders")
    } else if name.len() > MAX_NAME {
        Some("it is longer than 255 bytes")
    } else if name.contains(['/', '\\']) {
        Some("it contains '/' or '\\'")
    } else if name.chars().any(char::is_control) {
        Some("it contains a NUL or control character")
    } else {
        None
    }
}

/// Shows a name in an error message without letting control characters through.
fn shown(name: &str) -> String {
    name.escape_debug().to_string()
}

/// A model name: one plain path component (no `/`, `\`, NUL or control characters, not `.` or
/// `..`, at most 255 bytes), so that joining it to a repository folder stays in that folder.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelName(String);

impl ModelName {
    /// Checks a model name from a request, a repository listing or the in-process API.
    pub fn parse(name: &str) -> Result<Self> {
        match component_problem(name) {
            None => Ok(Self(name.to_owned())),
            Some(why) => Err(Error::invalid(format!(
                "invalid model name '{}': {why}; a model name is one folder name of the model \
                 repository",
                shown(name)
            ))),
        }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ModelName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A LoRA adapter's name, the part after `:` in `model:adapter`: letters, digits, `.`, `_` and
/// `-`, not starting with `.`, at most 128 bytes, so that it is one plain folder name (an
/// adapter kept in the repository is the model's `adapters/<name>/`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AdapterName(String);

impl AdapterName {
    /// Checks an adapter's name from a model name (`model:adapter`) or a request parameter.
    pub fn parse(name: &str) -> Result<Self> {
        let plain = !name.is_empty()
            && name.len() <= 128
            && !name.starts_with('.')
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if plain {
            Ok(Self(name.to_owned()))
        } else {
            Err(Error::invalid(format!(
                "invalid adapter name '{}': an adapter's name is 1 to 128 letters, digits, '.', \
                 '_' or '-', not starting with '.'",
                shown(name)
            )))
        }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// `model:adapter` split at its first `:`, when it has one.
pub fn split_adapter(name: &str) -> Option<(&str, &str)> {
    name.split_once(':')
}

/// A file of a model given to the load API (`file:1/model.onnx`): a relative path of plain
/// components (each as for [`ModelName`]), no empty part (`1//m`), no `.`/`..`, at most 8 deep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFilePath {
    parts: Vec<String>,
}

impl ModelFilePath {
    /// Checks the path of a `file:` load parameter (`key` is the path after `file:`).
    pub fn parse(key: &str) -> Result<Self> {
        let refuse = |why: &str| {
            Error::invalid(format!(
                "load parameter 'file:{}': {why}; a file is named by a path relative to the \
                 model folder, such as 'file:1/model.onnx'",
                shown(key)
            ))
        };
        if key.is_empty() {
            return Err(refuse("the path is empty"));
        }
        let parts: Vec<&str> = key.split('/').collect();
        if parts.len() > MAX_DEPTH {
            return Err(refuse("the path is more than 8 folders deep"));
        }
        for part in &parts {
            if let Some(why) = component_problem(part) {
                return Err(refuse(&format!(
                    "the part '{}' is refused: {why}",
                    shown(part)
                )));
            }
        }
        Ok(Self {
            parts: parts.into_iter().map(str::to_owned).collect(),
        })
    }

    /// The components, outermost first; the last is the file's name.
    pub fn parts(&self) -> &[String] {
        &self.parts
    }

    /// As a relative path.
    pub fn to_path(&self) -> PathBuf {
        self.parts.iter().collect()
    }
}

impl fmt::Display for ModelFilePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.parts.join("/"))
    }
}

/// A POSIX shared-memory key (`/name` or `name`, as `shm_open` takes it): one plain name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmKey(String);

impl ShmKey {
    /// Checks a key given to the shared-memory register API.
    pub fn parse(key: &str) -> Result<Self> {
        // shm_open skips every leading slash.
        let name = key.trim_start_matches('/');
        match component_problem(name) {
            None => Ok(Self(name.to_owned())),
            Some(why) => Err(Error::invalid(format!(
                "shared memory key '{}' is not a POSIX shared memory name ({why}): one '/name', \
                 as given to shm_open",
                shown(key)
            ))),
        }
    }

    /// The name without its leading `/` (the file's name under `/dev/shm`).
    pub fn file_name(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_are_one_plain_component() {
        for good in ["simple", "my-model_2.onnx", "ünï", "a b", "..x", "x.."] {
            assert_eq!(ModelName::parse(good).unwrap().as_str(), good);
        }
        for bad in [
            "", ".", "..", "a/b", "x/../y", "/etc", "a\\b", "a\0b", "a\nb", "\u{7f}",
        ] {
            let err = ModelName::parse(bad).unwrap_err();
            assert!(
                err.message.starts_with("invalid model name"),
                "{bad:?}: {err:?}"
            );
        }
        assert!(ModelName::parse(&"m".repeat(256)).is_err());
        assert!(!ModelName::parse("a\0b").unwrap_err().message.contains('\0'));
    }

    #[test]
    fn file_keys_are_normal_relative_paths() {
        let p = ModelFilePath::parse("1/model.onnx").unwrap();
        assert_eq!(p.parts(), ["1", "model.onnx"]);
        assert_eq!(p.to_path(), PathBuf::from("1/model.onnx"));
        for bad in [
            "",
            "/",
            "/etc/passwd",
            "1//model.onnx",
            "1/./model.onnx",
            "../x",
            "1/",
            "a\0b",
            "a\\..\\b",
            "a/b/c/d/e/f/g/h/i",
        ] {
            let err = ModelFilePath::parse(bad).unwrap_err();
            assert!(
                err.message.contains("load parameter 'file:"),
                "{bad:?}: {err:?}"
            );
        }
    }

    #[test]
    fn shm_keys_are_single_names() {
        assert_eq!(ShmKey::parse("/input0").unwrap().file_name(), "input0");
        assert_eq!(ShmKey::parse("out").unwrap().file_name(), "out");
        for bad in ["", "/", "/../etc/passwd", "/a/b", "..", "/..", "a\0"] {
            let err = ShmKey::parse(bad).unwrap_err();
            assert!(
                err.message.contains("POSIX shared memory name"),
                "{bad:?}: {err:?}"
            );
        }
    }
}
