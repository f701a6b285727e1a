//! Model repositories: directories of `<model>/config.pbtxt` and numeric version folders, the
//! version policy that picks which versions to serve, and the checks on a configuration that do
//! not need the model file.

pub mod checksum;
pub mod config;
pub mod config_fields;
pub mod remote;
pub mod sequence;
pub mod validate;

use std::{
    collections::BTreeMap,
    hash::{Hash, Hasher},
    path::{Path, PathBuf},
};

use crate::proto::inference::{
    model_version_policy::PolicyChoice, ModelConfig, ModelVersionPolicy,
};

pub use config::ConfigError;

/// File name of a model's configuration inside its directory.
pub const CONFIG_FILE: &str = "config.pbtxt";

/// What separates a model's name from its repository's position in a key with namespacing.
pub const NAMESPACE_MARK: char = '@';

/// Why a repository could not be read.
#[derive(Debug, thiserror::Error)]
pub enum RepositoryError {
    /// A repository root or model directory could not be listed.
    #[error("cannot read model repository '{path}': {source}")]
    Io {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The same model name appears in more than one repository.
    #[error("model '{name}' appears in more than one repository: {first} and {second}")]
    Duplicate {
        /// The model name.
        name: String,
        /// First repository holding it.
        first: PathBuf,
        /// Second repository holding it.
        second: PathBuf,
    },
    /// No repository holds the model.
    #[error("model '{0}' is not in any model repository")]
    NotFound(String),
}

/// Where a model lives on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSource {
    /// Model name (the directory name).
    pub name: String,
    /// The model's directory.
    pub dir: PathBuf,
    /// The repository root it was found in.
    pub repository: PathBuf,
}

impl ModelSource {
    /// Path of the model's `config.pbtxt`.
    pub fn config_path(&self) -> PathBuf {
        self.dir.join(CONFIG_FILE)
    }

    /// Reads and parses `config.pbtxt`; a missing file gives an empty configuration for the
    /// backend to auto-complete.
    pub fn read_config(&self) -> Result<ModelConfig, ConfigError> {
        self.read_config_and_text().map(|(config, _)| config)
    }

    /// [`Self::read_config`], with the file's text (`None` when there is no file), for
    /// messages that name a line.
    pub fn read_config_and_text(&self) -> Result<(ModelConfig, Option<String>), ConfigError> {
        let path = self.config_path();
        match std::fs::read_to_string(&path) {
            Ok(text) => config::parse_text(&text, &path).map(|c| (c, Some(text))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Ok((ModelConfig::default(), None))
            }
            Err(e) => Err(ConfigError::Invalid {
                file: path.display().to_string(),
                message: format!("cannot read: {e}"),
            }),
        }
    }

    /// Numeric version folders present, ascending.
    pub fn available_versions(&self) -> Vec<i64> {
        let mut versions: Vec<i64> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().to_str()?.parse::<i64>().ok())
            .filter(|v| *v >= 0)
            .collect();
        versions.sort_unstable();
        versions
    }

    /// A fingerprint of every file under the model directory (path, size, modification time),
    /// used by poll mode to notice changes.
    pub fn fingerprint(&self) -> u64 {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        hash_tree(&self.dir, &mut hasher);
        hasher.finish()
    }
}

fn hash_tree(dir: &Path, hasher: &mut impl Hasher) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        entry.file_name().hash(hasher);
        let Ok(meta) = entry.metadata() else { continue };
        if meta.is_dir() {
            hash_tree(&entry.path(), hasher);
        } else {
            meta.len().hash(hasher);
            if let Ok(modified) = meta.modified() {
                modified.hash(hasher);
            }
        }
    }
}

/// One or more repository roots, searched in order; remote ones are served from their local
/// copies ([`remote::Mirror`]), which [`ModelRepository::refresh`] brings up to date.
///
/// Models are known by a *key*: the folder name, unique across the roots. With namespacing
/// (Triton's `--model-namespacing=true`) each root is a namespace of its own, so that two roots
/// may hold the same name: every key is then `<name>@<n>`, `n` the root's position from 1
/// (see [`ModelRepository::key`]), and a request's plain name is resolved to one of them.
#[derive(Debug, Clone)]
pub struct ModelRepository {
    roots: Vec<PathBuf>,
    mirrors: Vec<std::sync::Arc<remote::Mirror>>,
    namespacing: bool,
}

impl ModelRepository {
    /// A repository set over the given roots.
    pub fn new(roots: Vec<PathBuf>) -> Self {
        Self {
            roots,
            mirrors: Vec::new(),
            namespacing: false,
        }
    }

    /// Makes each root a namespace of its own (Triton's `--model-namespacing`).
    pub fn with_namespacing(mut self, on: bool) -> Self {
        self.namespacing = on;
        self
    }

    /// Whether each root is a namespace of its own.
    pub fn namespacing(&self) -> bool {
        self.namespacing
    }

    /// The key of model folder `name` of the root at `position` (from 0): the name, or
    /// `<name>@<position + 1>` with namespacing.
    pub fn key(&self, position: usize, name: &str) -> String {
        if self.namespacing {
            format!("{name}{NAMESPACE_MARK}{}", position + 1)
        } else {
            name.to_owned()
        }
    }

    /// The folder name and the root's position (from 0) a key names, when it is a key of
    /// this repository set with namespacing (`name@n`, `n` a root's position from 1).
    pub fn split_key<'a>(&self, key: &'a str) -> Option<(&'a str, usize)> {
        if !self.namespacing {
            return None;
        }
        let (name, n) = key.rsplit_once(NAMESPACE_MARK)?;
        let canonical =
            !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) && !n.starts_with('0');
        let n: usize = n.parse().ok().filter(|_| canonical)?;
        (n >= 1 && n <= self.roots.len() && !name.is_empty()).then_some((name, n - 1))
    }

    /// The keys of every root's folder called `name`, in root order (one at most without
    /// namespacing).
    pub fn keys_of(&self, name: &str) -> Vec<String> {
        if crate::names::ModelName::parse(name).is_err() || name.starts_with('.') {
            return Vec::new();
        }
        self.roots
            .iter()
            .enumerate()
            .filter(|(_, root)| root.join(name).is_dir())
            .map(|(i, _)| self.key(i, name))
            .collect()
    }

    /// Adds remote repositories (already synced once), searched after the local roots.
    pub fn with_mirrors(mut self, mirrors: Vec<std::sync::Arc<remote::Mirror>>) -> Self {
        self.roots
            .extend(mirrors.iter().map(|m| m.local_dir().to_owned()));
        self.mirrors = mirrors;
        self
    }

    /// Updates the local copies of the remote repositories. A repository that cannot be read
    /// now keeps its last copy (the models already loaded keep serving) and is logged.
    pub async fn refresh(&self) {
        for mirror in &self.mirrors {
            match mirror.sync().await {
                Ok(report) if report != remote::SyncReport::default() => {
                    tracing::info!(
                        repository = mirror.url(),
                        fetched = report.fetched,
                        removed = report.removed,
                        "remote model repository changed"
                    );
                }
                Ok(_) => {}
                Err(e) => tracing::warn!("{e}; serving the last copy"),
            }
        }
    }

    /// The repository roots.
    pub fn roots(&self) -> &[PathBuf] {
        &self.roots
    }

    /// Every model directory in every root, by key.
    pub fn discover(&self) -> Result<BTreeMap<String, ModelSource>, RepositoryError> {
        let mut models: BTreeMap<String, ModelSource> = BTreeMap::new();
        for (position, root) in self.roots.iter().enumerate() {
            let entries = std::fs::read_dir(root).map_err(|source| RepositoryError::Io {
                path: root.clone(),
                source,
            })?;
            for entry in entries.flatten() {
                let path = entry.path();
                let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                    continue;
                };
                if !path.is_dir() || name.starts_with('.') {
                    continue;
                }
                if let Err(e) = crate::names::ModelName::parse(&name) {
                    tracing::warn!(folder = %path.display(), "skipping a folder that is no model name: {}", e.message);
                    continue;
                }
                if self.namespacing && name.contains(NAMESPACE_MARK) {
                    tracing::warn!(folder = %path.display(), "skipping a folder whose name holds '{NAMESPACE_MARK}': with --model-namespacing it separates a model's name from its repository's position");
                    continue;
                }
                let key = self.key(position, &name);
                if let Some(existing) = models.get(&key) {
                    return Err(RepositoryError::Duplicate {
                        name,
                        first: existing.repository.clone(),
                        second: root.clone(),
                    });
                }
                models.insert(
                    key,
                    ModelSource {
                        name,
                        dir: path,
                        repository: root.clone(),
                    },
                );
            }
        }
        Ok(models)
    }

    /// Finds one model by key.
    pub fn find(&self, name: &str) -> Result<ModelSource, RepositoryError> {
        if self.namespacing {
            return self
                .split_key(name)
                .map(|(folder, position)| (folder, &self.roots[position]))
                .filter(|(folder, _)| !folder.starts_with('.') && !folder.contains(NAMESPACE_MARK))
                .filter(|(folder, _)| crate::names::ModelName::parse(folder).is_ok())
                .filter(|(folder, root)| root.join(folder).is_dir())
                .map(|(folder, root)| ModelSource {
                    name: folder.to_owned(),
                    dir: root.join(folder),
                    repository: root.clone(),
                })
                .ok_or_else(|| RepositoryError::NotFound(name.to_owned()));
        }
        let mut found: Option<ModelSource> = None;
        // Only a plain folder name is joined to a root (`/etc` or `../x` would leave it).
        if crate::names::ModelName::parse(name).is_err() || name.starts_with('.') {
            return Err(RepositoryError::NotFound(name.to_owned()));
        }
        for root in &self.roots {
            let dir = root.join(name);
            if dir.is_dir() {
                if let Some(first) = &found {
                    return Err(RepositoryError::Duplicate {
                        name: name.to_owned(),
                        first: first.repository.clone(),
                        second: root.clone(),
                    });
                }
                found = Some(ModelSource {
                    name: name.to_owned(),
                    dir,
                    repository: root.clone(),
                });
            }
        }
        found.ok_or_else(|| RepositoryError::NotFound(name.to_owned()))
    }
}

/// Applies a version policy to the available versions (ascending input, ascending output).
/// No policy means `latest { num_versions: 1 }`.
pub fn select_versions(policy: Option<&ModelVersionPolicy>, available: &[i64]) -> Vec<i64> {
    match policy.and_then(|p| p.policy_choice.as_ref()) {
        Some(PolicyChoice::All(_)) => available.to_vec(),
        Some(PolicyChoice::Specific(s)) => available
            .iter()
            .copied()
            .filter(|v| s.versions.contains(v))
            .collect(),
        Some(PolicyChoice::Latest(l)) => {
            let n = (l.num_versions.max(1)) as usize;
            available[available.len().saturating_sub(n)..].to_vec()
        }
        None => available[available.len().saturating_sub(1)..].to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::inference::model_version_policy::{All, Latest, Specific};

    #[test]
    fn version_policies() {
        let avail = [1, 2, 3, 7];
        assert_eq!(select_versions(None, &avail), vec![7]);
        let latest2 = ModelVersionPolicy {
            policy_choice: Some(PolicyChoice::Latest(Latest { num_versions: 2 })),
        };
        assert_eq!(select_versions(Some(&latest2), &avail), vec![3, 7]);
        let all = ModelVersionPolicy {
            policy_choice: Some(PolicyChoice::All(All {})),
        };
        assert_eq!(select_versions(Some(&all), &avail), avail.to_vec());
        let specific = ModelVersionPolicy {
            policy_choice: Some(PolicyChoice::Specific(Specific {
                versions: vec![2, 5],
            })),
        };
        assert_eq!(select_versions(Some(&specific), &avail), vec![2]);
        assert!(select_versions(None, &[]).is_empty());
    }
}
