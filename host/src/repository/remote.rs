//! Remote model repositories in object storage, as Triton names them: `s3://bucket/path`,
//! `s3://host:port/bucket/path` (an S3-compatible server, http), `s3://https://host:port/...`,
//! `gs://bucket/path` and `as://account/container/path`. Like Triton, the server serves a local
//! copy: a [`Mirror`] downloads the repository into a temporary directory and, on each
//! [`Mirror::sync`], fetches the objects whose ETag (or size and time) changed and deletes the
//! files whose objects are gone, so the local poll sees exactly what changed. Credentials come
//! from the standard environment variables of each cloud (`AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL`;
//! `GOOGLE_APPLICATION_CREDENTIALS`; `AZURE_STORAGE_ACCOUNT`, `AZURE_STORAGE_KEY`).
//!
//! The copy lives in a private directory with a random name (mode 0700, made atomically, so no
//! other local user can prepare or swap it); objects stream to disk, each under a size cap
//! ([`MAX_OBJECT_BYTES`]); an object the store lists but cannot name, or one that is too large
//! or would leave the copy, is skipped with a warning instead of stopping the sync.

use std::{
    collections::HashMap,
    os::unix::fs::DirBuilderExt,
    path::{Component, Path as FsPath, PathBuf},
    sync::Arc,
};

use futures::{StreamExt, TryStreamExt};
use object_store::{path::Path as ObjectPath, ObjectStore, ObjectStoreExt};

use crate::private_dir::ScratchDir;

/// Largest object copied from a remote repository (32 GiB: above any model file).
pub const MAX_OBJECT_BYTES: u64 = 32 << 30;

/// Why a remote repository cannot be opened or read.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The URL is not one of the supported forms.
    #[error("--model-repository {url}: {reason}")]
    Url {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The object store refused or failed.
    #[error("model repository {url}: {error}")]
    Store {
        /// The repository URL.
        url: String,
        /// The store's error (in the message, not chained, so that it is said once).
        error: object_store::Error,
    },
    /// The local copy could not be written.
    #[error("model repository {url}: cannot write the local copy at {}: {error}", path.display())]
    Io {
        /// The repository URL.
        url: String,
        /// The file.
        path: PathBuf,
        /// The error.
        error: std::io::Error,
    },
}

/// Whether a `--model-repository` value names object storage rather than a directory.
pub fn is_remote(location: &str) -> bool {
    ["s3://", "gs://", "as://"]
        .iter()
        .any(|scheme| location.starts_with(scheme))
}

/// Where a remote repository is: the store and the prefix inside it.
struct RemoteLocation {
    store: Arc<dyn ObjectStore>,
    prefix: String,
}

fn parse(url: &str) -> Result<RemoteLocation, RemoteError> {
    let bad = |reason: &str| RemoteError::Url {
        url: url.to_owned(),
        reason: reason.to_owned(),
    };
    let store_error = |error| RemoteError::Store {
        url: url.to_owned(),
        error,
    };
    let (scheme, rest) = url.split_once("://").ok_or_else(|| bad("not a URL"))?;
    let split = |rest: &str| -> (String, String) {
        match rest.split_once('/') {
            Some((first, tail)) => (first.to_owned(), tail.trim_matches('/').to_owned()),
            None => (rest.to_owned(), String::new()),
        }
    };
    let target = match scheme {
        "s3" => {
            // s3://https://host:port/bucket/path, s3://http://..., s3://host:port/bucket/path
            let (endpoint, rest) = if let Some(tail) = rest.strip_prefix("https://") {
                let (host, rest) = split(tail);
                (Some(format!("https://{host}")), rest)
            } else if let Some(tail) = rest.strip_prefix("http://") {
                let (host, rest) = split(tail);
                (Some(format!("http://{host}")), rest)
            } else {
                let (first, tail) = split(rest);
                if first.contains(':') {
                    (Some(format!("http://{first}")), tail)
                } else {
                    (None, rest.to_owned())
                }
            };
            let (bucket, prefix) = split(&rest);
            if bucket.is_empty() {
                return Err(bad(
                    "no bucket (s3://bucket/path or s3://host:port/bucket/path)",
                ));
            }
            let mut builder =
                object_store::aws::AmazonS3Builder::from_env().with_bucket_name(&bucket);
            if std::env::var_os("AWS_DEFAULT_REGION").is_none()
                && std::env::var_os("AWS_REGION").is_none()
            {
                builder = builder.with_region("us-east-1");
            }
            if let Some(endpoint) = endpoint {
                builder = builder
                    .with_allow_http(endpoint.starts_with("http://"))
                    .with_endpoint(endpoint)
                    .with_virtual_hosted_style_request(false);
            }
            RemoteLocation {
                store: Arc::new(builder.build().map_err(store_error)?),
                prefix,
            }
        }
        "gs" => {
            let (bucket, prefix) = split(rest);
            if bucket.is_empty() {
                return Err(bad("no bucket (gs://bucket/path)"));
            }
            let builder =
                object_store::gcp::GoogleCloudStorageBuilder::from_env().with_bucket_name(&bucket);
            RemoteLocation {
                store: Arc::new(builder.build().map_err(store_error)?),
                prefix,
            }
        }
        "as" => {
            let (account, rest) = split(rest);
            let (container, prefix) = split(&rest);
            if account.is_empty() || container.is_empty() {
                return Err(bad(
                    "needs an account and a container (as://account/container/path)",
                ));
            }
            let mut builder = object_store::azure::MicrosoftAzureBuilder::from_env()
                .with_account(&account)
                .with_container_name(&container);
            // Triton's variable; object_store reads AZURE_STORAGE_ACCOUNT_KEY itself.
            if let Ok(key) = std::env::var("AZURE_STORAGE_KEY") {
                builder = builder.with_access_key(key);
            }
            RemoteLocation {
                store: Arc::new(builder.build().map_err(store_error)?),
                prefix,
            }
        }
        _ => return Err(bad("unknown scheme (s3://, gs:// or as://)")),
    };
    Ok(target)
}

/// Splits repository locations into remote repositories, each copied under `parent` once
/// before any model loads (as Triton does), and local directories. The binary's
/// `--model-repository` values and the Python package's `model_repository` both come here.
pub async fn open_repositories(
    locations: &[String],
    parent: &FsPath,
) -> Result<(Vec<Arc<Mirror>>, Vec<std::path::PathBuf>), RemoteError> {
    let mut remote = Vec::new();
    let mut local = Vec::new();
    for location in locations {
        if !is_remote(location) {
            local.push(std::path::PathBuf::from(location));
            continue;
        }
        let mirror = Mirror::open(location, parent)?;
        let report = mirror.sync().await?;
        tracing::info!(
            repository = %location,
            objects = report.fetched,
            copy = %mirror.local_dir().display(),
            "copied the remote model repository"
        );
        remote.push(Arc::new(mirror));
    }
    Ok((remote, local))
}

/// A remote repository and its local copy (removed when the mirror is dropped).
pub struct Mirror {
    url: String,
    store: Arc<dyn ObjectStore>,
    prefix: Option<ObjectPath>,
    local: ScratchDir,
    max_object_bytes: u64,
    /// Version (ETag, else size and time) of each object copied, by relative path.
    copied: tokio::sync::Mutex<HashMap<String, String>>,
}

impl std::fmt::Debug for Mirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mirror")
            .field("url", &self.url)
            .field("local", &self.local.path())
            .finish()
    }
}

/// What one [`Mirror::sync`] changed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SyncReport {
    /// Objects downloaded (new or changed).
    pub fetched: usize,
    /// Local files removed because their objects are gone.
    pub removed: usize,
}

impl Mirror {
    /// Opens the repository at `url` with a local copy in a new directory under `parent`.
    /// Nothing is downloaded until [`Mirror::sync`].
    pub fn open(url: &str, parent: &FsPath) -> Result<Self, RemoteError> {
        let target = parse(url)?;
        let local = ScratchDir::new_in(parent, "wasmtron-repository-").map_err(|error| {
            RemoteError::Io {
                url: url.to_owned(),
                path: parent.to_owned(),
                error,
            }
        })?;
        Ok(Self {
            url: url.to_owned(),
            store: target.store,
            prefix: (!target.prefix.is_empty()).then(|| ObjectPath::from(target.prefix.as_str())),
            local,
            max_object_bytes: MAX_OBJECT_BYTES,
            copied: Default::default(),
        })
    }

    /// The URL as given.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The directory the server reads the repository from.
    pub fn local_dir(&self) -> &FsPath {
        self.local.path()
    }

    /// Brings the local copy up to date: downloads new and changed objects (each written to a
    /// temporary name and renamed into place), removes files whose objects are gone. Objects
    /// whose path would leave the copy (`..`) are skipped.
    pub async fn sync(&self) -> Result<SyncReport, RemoteError> {
        let mut copied = self.copied.lock().await;
        let store_error = |error| RemoteError::Store {
            url: self.url.clone(),
            error,
        };
        let mut listed = self.store.list(self.prefix.as_ref());
        let (mut listing, mut first_error) = (Vec::new(), None);
        while let Some(item) = listed.next().await {
            match item {
                Ok(meta) => listing.push(meta),
                Err(error) => {
                    // One key the store cannot name must not stop every later sync.
                    tracing::warn!(repository = %self.url, %error, "skipping an object the store lists but cannot read");
                    first_error.get_or_insert(error);
                }
            }
        }
        if let (true, Some(error)) = (listing.is_empty(), first_error) {
            return Err(store_error(error));
        }
        let mut present = HashMap::new();
        let mut report = SyncReport::default();
        for meta in listing {
            let Some(relative) = self.relative(&meta.location) else {
                tracing::warn!(repository = %self.url, object = %meta.location, "skipping an object whose path would leave the local copy");
                continue;
            };
            if meta.size > self.max_object_bytes {
                tracing::warn!(repository = %self.url, object = %meta.location, bytes = meta.size, "skipping an object larger than the cap of {} bytes", self.max_object_bytes);
                continue;
            }
            let version = meta
                .e_tag
                .clone()
                .unwrap_or_else(|| format!("{}@{}", meta.size, meta.last_modified));
            if copied.get(&relative) != Some(&version) {
                self.fetch(&meta.location, &relative).await?;
                report.fetched += 1;
            }
            present.insert(relative, version);
        }
        for gone in copied.keys().filter(|k| !present.contains_key(*k)) {
            let path = self.local.path().join(gone);
            if std::fs::remove_file(&path).is_ok() {
                report.removed += 1;
            }
            // Empty model and version directories go too, so the model disappears.
            let mut dir = path.parent();
            while let Some(d) = dir.filter(|d| *d != self.local.path()) {
                if std::fs::remove_dir(d).is_err() {
                    break;
                }
                dir = d.parent();
            }
        }
        *copied = present;
        Ok(report)
    }

    /// The object's path below the prefix, if it is a file that stays inside the copy.
    fn relative(&self, location: &ObjectPath) -> Option<String> {
        let parts: Vec<String> = match &self.prefix {
            Some(prefix) => location
                .prefix_match(prefix)?
                .map(|p| p.as_ref().to_owned())
                .collect(),
            None => location.parts().map(|p| p.as_ref().to_owned()).collect(),
        };
        let relative = parts.join("/");
        let safe = !relative.is_empty()
            && FsPath::new(&relative)
                .components()
                .all(|c| matches!(c, Component::Normal(_)));
        safe.then_some(relative)
    }

    /// Streams one object to its place in the copy: into a new file with a random name (never
    /// a link), renamed into place once whole, refused past the size cap.
    async fn fetch(&self, location: &ObjectPath, relative: &str) -> Result<(), RemoteError> {
        let path = self.local.path().join(relative);
        let io = |path: &FsPath, error| RemoteError::Io {
            url: self.url.clone(),
            path: path.to_owned(),
            error,
        };
        let store_error = |error| RemoteError::Store {
            url: self.url.clone(),
            error,
        };
        let mut stream = self
            .store
            .get(location)
            .await
            .map_err(store_error)?
            .into_stream();
        let mut partial = tempfile::Builder::new()
            .prefix(".partial-")
            .tempfile_in(self.local.path())
            .map_err(|e| io(self.local.path(), e))?;
        let mut written = 0u64;
        while let Some(chunk) = stream.try_next().await.map_err(store_error)? {
            written += chunk.len() as u64;
            if written > self.max_object_bytes {
                return Err(io(
                    &path,
                    std::io::Error::other(format!(
                        "the object is larger than the cap of {} bytes",
                        self.max_object_bytes
                    )),
                ));
            }
            std::io::Write::write_all(&mut partial, &chunk).map_err(|e| io(&path, e))?;
        }
        if let Some(parent) = path.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(parent)
                .map_err(|e| io(parent, e))?;
        }
        partial
            .persist(&path)
            .map(drop)
            .map_err(|e| io(&path, e.error))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::{memory::InMemory, PutPayload};

    fn mirror(store: Arc<dyn ObjectStore>, prefix: &str) -> Mirror {
        Mirror {
            url: "mem://test".into(),
            store,
            prefix: Some(ObjectPath::from(prefix)),
            local: ScratchDir::new("wasmtron-mirror-test-").unwrap(),
            max_object_bytes: MAX_OBJECT_BYTES,
            copied: Default::default(),
        }
    }

    #[tokio::test]
    async fn sync_fetches_what_changed_and_removes_what_is_gone() {
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let put = |path: &str, text: &str| {
            let store = store.clone();
            let (path, payload) = (ObjectPath::from(path), PutPayload::from(text.to_owned()));
            async move { store.put(&path, payload).await.unwrap() }
        };
        put("repo/a/config.pbtxt", "name: \"a\"").await;
        put("repo/a/1/model.onnx", "onnx").await;
        put("other/b/config.pbtxt", "not ours").await;
        let m = mirror(store.clone(), "repo");
        let dir = m.local_dir().to_path_buf();
        assert_eq!(
            m.sync().await.unwrap(),
            SyncReport {
                fetched: 2,
                removed: 0
            }
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("a/1/model.onnx")).unwrap(),
            "onnx"
        );
        assert!(!dir.join("b").exists());
        // Nothing changed: nothing fetched.
        assert_eq!(m.sync().await.unwrap(), SyncReport::default());
        put("repo/a/config.pbtxt", "name: \"a\" max_batch_size: 4").await;
        put("repo/c/config.pbtxt", "name: \"c\"").await;
        assert_eq!(
            m.sync().await.unwrap(),
            SyncReport {
                fetched: 2,
                removed: 0
            }
        );
        assert!(std::fs::read_to_string(dir.join("a/config.pbtxt"))
            .unwrap()
            .contains("4"));
        store
            .delete(&ObjectPath::from("repo/c/config.pbtxt"))
            .await
            .unwrap();
        assert_eq!(
            m.sync().await.unwrap(),
            SyncReport {
                fetched: 0,
                removed: 1
            }
        );
        assert!(!dir.join("c").exists(), "an emptied model directory goes");
        drop(m);
        assert!(!dir.exists(), "the local copy is removed with the mirror");
    }

    #[tokio::test]
    async fn objects_past_the_cap_are_skipped_and_the_rest_copied() {
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        for (path, text) in [
            ("repo/a/config.pbtxt", "small"),
            ("repo/a/1/model.onnx", "x".repeat(100).as_str()),
        ] {
            store
                .put(&ObjectPath::from(path), PutPayload::from(text.to_owned()))
                .await
                .unwrap();
        }
        let mut m = mirror(store, "repo");
        m.max_object_bytes = 10;
        assert_eq!(m.sync().await.unwrap().fetched, 1);
        assert!(m.local_dir().join("a/config.pbtxt").is_file());
        assert!(!m.local_dir().join("a/1/model.onnx").exists());
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(m.local_dir()).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o700);
    }

    #[test]
    fn urls_in_triton_forms_are_understood_and_mistakes_named() {
        assert!(is_remote("s3://b/p") && is_remote("gs://b") && is_remote("as://a/c"));
        assert!(!is_remote("/models") && !is_remote("models"));
        for good in [
            "s3://bucket/repo",
            "s3://127.0.0.1:9000/bucket/repo",
            "s3://https://h:9/b/r",
        ] {
            assert!(parse(good).is_ok(), "{good}");
        }
        for (bad, says) in [
            ("s3://", "no bucket"),
            ("s3://127.0.0.1:9000/", "no bucket"),
            ("as://account", "account and a container"),
            ("ftp://x/y", "unknown scheme"),
        ] {
            let err = parse(bad).err().unwrap().to_string();
            assert!(err.contains(says) && err.contains(bad), "{bad}: {err}");
        }
    }
}
