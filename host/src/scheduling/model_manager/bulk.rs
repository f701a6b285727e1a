//! Loading many models at once: every model of the repositories at start-up, the ones
//! `--load-model` names, and poll mode's reconciliation with the repositories.

use std::{collections::HashSet, sync::Arc};

use super::{repo_error, LoadOverride, ModelManager};
use crate::error::Result;

impl ModelManager {
    /// Loads every model found in the repositories; failures are recorded, not fatal.
    pub async fn load_all(self: &Arc<Self>) -> Result<()> {
        let names: Vec<String> = self
            .repository
            .discover()
            .map_err(repo_error)?
            .into_keys()
            .collect();
        self.load_many(&names).await;
        Ok(())
    }

    /// Loads the named models, up to `load_threads` at once (as Triton's model-load threads):
    /// first those that call no other model, then the ensembles and stages that call some,
    /// each after what it calls. Failures are recorded in the index.
    pub async fn load_many(self: &Arc<Self>, names: &[String]) {
        use futures::stream::StreamExt;
        // With namespacing, a plain name means every repository's model of that name.
        let keys: Vec<String> = names
            .iter()
            .flat_map(|n| match self.load_keys(n) {
                Ok(keys) => keys,
                // Loaded as named, for its load to fail saying why (and show in the index).
                Err(_) => vec![n.clone()],
            })
            .collect();
        let names = keys.as_slice();
        let _guard = self.lifecycle.lock().await;
        let (standalone, calling): (Vec<&String>, Vec<&String>) = names.iter().partition(|name| {
            self.composing_of(name, &LoadOverride::default())
                .is_ok_and(|calls| calls.is_empty())
        });
        futures::stream::iter(&standalone)
            .for_each_concurrent(self.options.load_threads.max(1), |name| async move {
                let _ = self.load_locked(name, LoadOverride::default()).await;
            })
            .await;
        let mut done: HashSet<String> = standalone.into_iter().cloned().collect();
        for name in calling {
            if !done.contains(name) {
                let _ = self
                    .load_with_composing(name, LoadOverride::default(), &mut done)
                    .await;
            }
        }
    }

    /// Poll mode: loads new models, reloads changed ones and unloads removed ones.
    pub async fn poll(self: &Arc<Self>) {
        self.repository.refresh().await;
        let Ok(found) = self.repository.discover() else {
            return;
        };
        let known: Vec<(String, u64)> = self
            .models
            .read()
            .map(|m| {
                m.iter()
                    .filter(|(_, e)| !e.added)
                    .map(|(k, e)| (k.clone(), e.fingerprint))
                    .collect()
            })
            .unwrap_or_default();
        for (name, _) in known.iter().filter(|(n, _)| !found.contains_key(n)) {
            let _ = self.unload(name, false).await;
            if let Ok(mut m) = self.models.write() {
                m.remove(name);
            }
        }
        let added: HashSet<String> = self
            .models
            .read()
            .map(|m| {
                m.iter()
                    .filter(|(_, e)| e.added)
                    .map(|(k, _)| k.clone())
                    .collect()
            })
            .unwrap_or_default();
        for (name, source) in found {
            if added.contains(&name) {
                tracing::warn!(model = %name, "a model added in-process has this name; the repository's is not loaded");
                continue;
            }
            let previous = known.iter().find(|(n, _)| *n == name).map(|(_, f)| *f);
            if previous != Some(source.fingerprint()) {
                let _ = self.load_as_is(&name, LoadOverride::default()).await;
            }
        }
        self.relink_ensembles().await;
    }
}
