//! Loads and unloads a model asks for while it runs (Triton's Python model loading API:
//! `pb_utils.load_model`, `unload_model`). Triton's own example loads the models it calls in
//! `initialize`, which runs inside the load of the model itself: that load holds the
//! lifecycle lock and waits for `initialize`, so a load asked for from there runs inside it
//! instead of waiting for the lock (which would never come).

use std::{collections::HashSet, sync::Arc};

use super::{LoadOverride, ModelManager};
use crate::{
    error::{Error, Result},
    names::ModelName,
};

/// Marks a model as being loaded (its versions read and initialized) while it lives.
pub(super) struct Loading<'a> {
    manager: &'a ModelManager,
    name: String,
}

impl<'a> Loading<'a> {
    pub(super) fn start(manager: &'a ModelManager, name: &str) -> Self {
        manager.loading_set().insert(name.to_owned());
        Self {
            manager,
            name: name.to_owned(),
        }
    }
}

impl Drop for Loading<'_> {
    fn drop(&mut self) {
        self.manager.loading_set().remove(&self.name);
    }
}

impl ModelManager {
    fn loading_set(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.loading
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether `name` is being loaded now (its `initialize` may be running).
    fn is_loading(&self, name: &str) -> bool {
        self.loading_set().contains(name)
    }

    /// Loads `name` for model `by`, which runs now: inside `by`'s own load when it is being
    /// loaded, else as any load.
    pub async fn load_for_model(
        self: &Arc<Self>,
        by: &str,
        name: &str,
        overrides: LoadOverride,
    ) -> Result<()> {
        let name = ModelName::parse(name)?;
        if name.as_str() == by {
            return Err(Error::invalid(format!(
                "model '{by}' cannot load itself (load_model names the model that calls it)"
            )));
        }
        if self.is_loading(name.as_str()) {
            // Models loading each other from their `initialize` would never end.
            return Err(Error::unavailable(format!(
                "model '{name}' is being loaded already: model '{by}' cannot load it now"
            )));
        }
        if !self.is_loading(by) {
            return self.load(name.as_str(), overrides).await;
        }
        self.repository().refresh().await;
        self.load_with_composing(name.as_str(), overrides, &mut HashSet::new())
            .await
    }

    /// Unloads `name` for model `by`, which runs now (inside `by`'s own load when it is being
    /// loaded).
    pub async fn unload_for_model(
        &self,
        by: &str,
        name: &str,
        unload_dependents: bool,
    ) -> Result<()> {
        if name == by {
            return Err(Error::invalid(format!(
                "model '{by}' cannot unload itself (unload_model names the model that calls it)"
            )));
        }
        if self.is_loading(by) {
            self.unload_locked(name, unload_dependents)
        } else {
            self.unload(name, unload_dependents).await
        }
    }
}
