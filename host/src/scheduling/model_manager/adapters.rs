//! Adapters through the repository API: `model:adapter` names adapter `adapter` of the loaded
//! model `model` (one whose backend takes adapters: a generation model's LoRA adapters), or of
//! the models the ensemble `model` calls that take them. Loading it reads the adapter's files
//! (for LoRA, PEFT's `adapter_config.json` and `adapter_model.safetensors`) from the load
//! request's `file:` parameters, or else from the model's adapter folder (`adapters/<adapter>/`)
//! in the repository; loading it again replaces it; unloading drops it (requests running with
//! it finish with it). An adapter loaded from a request's files survives a reload of its
//! model: the new versions get it again before they serve (one from the repository's folder
//! is read again by the new versions themselves); unloading the model forgets it.

use super::*;
use crate::{
    names::{split_adapter, AdapterName},
    runtime::capabilities::AdapterStore,
};

/// The models that hold a model's adapters: their names and adapter stores.
type Holders = Vec<(String, Arc<dyn AdapterStore>)>;

/// Adapters loaded from a request's files: by holding model, each adapter's files' contents.
pub(super) type SentAdapters = HashMap<String, BTreeMap<String, Arc<Vec<Vec<u8>>>>>;

fn sent(manager: &ModelManager) -> std::sync::MutexGuard<'_, SentAdapters> {
    manager
        .sent_adapters
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl ModelManager {
    /// `(model, adapter)` when `name` names an adapter: `model:adapter` where `model` is loaded
    /// and the repository holds no model called `name`.
    pub fn adapter_ref<'a>(&self, name: &'a str) -> Option<(&'a str, &'a str)> {
        let (model, adapter) = split_adapter(name)?;
        (self.get(model, None).is_ok() && self.repository.find(name).is_err())
            .then_some((model, adapter))
    }

    /// The models behind `model` that take adapters (itself, or the steps of an ensemble),
    /// by name.
    fn adapter_holders(&self, model: &str) -> Result<Holders> {
        let version = self.get(model, None)?;
        let mut holders: Holders = Vec::new();
        if let Some(a) = &version.capabilities.adapters {
            holders.push((model.to_owned(), a.clone()));
        }
        if let Executor::Ensemble(ensemble) = &version.executor {
            for step in ensemble.models() {
                if holders.iter().any(|(n, _)| n == step) {
                    continue;
                }
                let store = self.get(step, None).ok();
                if let Some(a) = store.and_then(|v| v.capabilities.adapters.clone()) {
                    holders.push((step.to_owned(), a));
                }
            }
        }
        if holders.is_empty() {
            return Err(Error::invalid(format!(
                "model '{model}' takes no LoRA adapters: it is not a generation model whose \
                 decoder has adapter inputs (scripts/llm_export.py --lora), nor an ensemble \
                 calling one"
            )));
        }
        Ok(holders)
    }

    /// The adapters `model` runs with (its own, or its ensemble's generation models'), sorted.
    pub fn adapter_names(&self, model: &str) -> Vec<String> {
        let mut names: Vec<String> = self
            .adapter_holders(model)
            .unwrap_or_default()
            .iter()
            .flat_map(|(_, a)| a.names())
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// Loads adapter `adapter` of `model` from the load request's files or the repository.
    pub(super) async fn load_adapter(
        &self,
        model: &str,
        adapter: &str,
        overrides: LoadOverride,
    ) -> Result<()> {
        let adapter = AdapterName::parse(adapter)?;
        let holders = self.adapter_holders(model)?;
        let (folder, wanted) = match holders.first() {
            Some((_, store)) => (store.folder(), store.files()),
            None => return Err(Error::internal("no model holds the adapters")),
        };
        let listed = || {
            wanted
                .iter()
                .map(|f| format!("'file:{f}'"))
                .collect::<Vec<_>>()
                .join(" and ")
        };
        if overrides.config_json.is_some() {
            return Err(Error::invalid(format!(
                "failed to load adapter '{adapter}' of model '{model}': an adapter is loaded \
                 from {} (or the model's {folder}/{adapter}/ folder), not a 'config'",
                listed(),
                adapter = adapter.as_str()
            )));
        }
        if let Some((path, _)) = overrides
            .files
            .iter()
            .find(|(p, _)| !wanted.contains(&p.to_string().as_str()))
        {
            return Err(Error::invalid(format!(
                "failed to load adapter '{}' of model '{model}': load parameter 'file:{path}' is \
                 not one of an adapter's files ({})",
                adapter.as_str(),
                wanted.join(", ")
            )));
        }
        let mut jobs = Vec::new();
        for (holder, store) in holders {
            let dir = match overrides.files.is_empty() {
                true => Some(
                    self.repository
                        .find(&holder)
                        .map_err(|e| Error::not_found(e.to_string()))?
                        .dir
                        .join(store.folder())
                        .join(adapter.as_str()),
                ),
                false => None,
            };
            jobs.push((holder, (store, dir)));
        }
        let files = overrides.files;
        let name = adapter.as_str().to_owned();
        let model = model.to_owned();
        // Reading and preparing the weights is file and CPU work: off the async runtime.
        let loaded = tokio::task::spawn_blocking(move || {
            let mut loaded = Vec::new();
            for (holder, (store, dir)) in jobs {
                let contents = match &dir {
                    Some(dir) => store.read(dir)?,
                    None => store
                        .files()
                        .iter()
                        .map(|file| given(&files, file, store.files()))
                        .collect::<Result<Vec<_>>>()?,
                };
                store
                    .load(&name, &contents)
                    .map_err(|e| e.within(format_args!("failed to load '{model}:{name}'")))?;
                loaded.push((holder, dir.is_none().then(|| Arc::new(contents))));
            }
            Ok::<_, Error>(loaded)
        })
        .await
        .map_err(|e| Error::internal(format!("loading the adapter failed: {e}")))??;
        let mut sent = sent(self);
        for (holder, contents) in loaded {
            let held = sent.entry(holder).or_default();
            match contents {
                Some(contents) => held.insert(adapter.as_str().to_owned(), contents),
                // Read from the repository: a new version reads it again itself.
                None => held.remove(adapter.as_str()),
            };
        }
        Ok(())
    }

    /// Loads into `versions` (a reload of `model`) the adapters clients loaded into the
    /// versions they replace from a request's files; one that no longer fits is left out,
    /// said in the log.
    pub(super) fn reapply_adapters(
        &self,
        model: &str,
        versions: &BTreeMap<i64, Arc<ModelVersion>>,
    ) {
        let held = sent(self).get(model).cloned().unwrap_or_default();
        for (name, contents) in held {
            for version in versions.values() {
                let Some(store) = &version.capabilities.adapters else {
                    continue;
                };
                match store.load(&name, &contents) {
                    Ok(()) => {
                        tracing::info!(model, adapter = %name, "adapter loaded again after the reload")
                    }
                    Err(e) => {
                        tracing::warn!(model, adapter = %name, "adapter not loaded again after the reload: {}", e.message)
                    }
                }
            }
        }
    }

    /// Forgets the adapters clients loaded into `model` (it was unloaded).
    pub(super) fn forget_adapters(&self, model: &str) {
        sent(self).remove(model);
    }

    /// Unloads adapter `adapter` of `model`.
    pub(super) fn unload_adapter(&self, model: &str, adapter: &str) -> Result<()> {
        let adapter = AdapterName::parse(adapter)?;
        let mut result = Ok(());
        let mut unloaded = false;
        for (holder, adapters) in self.adapter_holders(model)? {
            match adapters.unload(adapter.as_str()) {
                Ok(()) => unloaded = true,
                Err(e) => result = Err(e),
            }
            if let Some(held) = sent(self).get_mut(&holder) {
                held.remove(adapter.as_str());
            }
        }
        if unloaded {
            Ok(())
        } else {
            result
        }
    }
}

/// One of an adapter's files (`wanted` lists them all) from the load request.
fn given(files: &[(ModelFilePath, Vec<u8>)], file: &str, wanted: &[&str]) -> Result<Vec<u8>> {
    files
        .iter()
        .find(|(p, _)| p.to_string() == file)
        .map(|(_, content)| content.clone())
        .ok_or_else(|| {
            let all: Vec<String> = wanted.iter().map(|f| format!("'file:{f}'")).collect();
            Error::invalid(format!(
                "loading an adapter from the request takes {}; 'file:{file}' is missing",
                all.join(" and ")
            ))
        })
}
