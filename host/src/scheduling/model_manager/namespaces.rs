//! Model namespacing (Triton's `--model-namespacing=true`): each repository root is a
//! namespace of its own, so two roots may hold models of the same name. A model's key is then
//! `<name>@<n>` (`n` its root's position, from 1: see [`ModelRepository::key`]); a request,
//! a load or an unload may name a model plainly, and this module says which keys that means:
//! - a request: the one loaded model of that name, or an error naming the ambiguity when
//!   several namespaces have one loaded (Triton's words);
//! - a load: every root's model of that name (Triton applies a load to all of them);
//! - an unload: every loaded one;
//! - an ensemble's step: the model of the ensemble's own namespace when there is one, else the
//!   one of that name elsewhere (as Triton links an ensemble to its composing models).
//!
//! Without namespacing a key is the name, and every function here answers the name itself.
//!
//! [`ModelRepository::key`]: crate::repository::ModelRepository::key

use std::{borrow::Cow, collections::HashMap, sync::Arc};

use super::{poisoned, Executor, ModelEntry, ModelManager};
use crate::{
    error::{Error, Result},
    names::ModelName,
    repository::NAMESPACE_MARK,
    scheduling::ensemble,
};

impl ModelManager {
    /// The key a request's model name stands for, given the table of models.
    pub(super) fn resolve_in<'a>(
        &self,
        models: &HashMap<String, ModelEntry>,
        name: &'a str,
    ) -> Result<Cow<'a, str>> {
        let repository = &self.repository;
        if !repository.namespacing() || repository.split_key(name).is_some() {
            return Ok(Cow::Borrowed(name));
        }
        match self.loaded_keys(models, name).as_slice() {
            [] => Ok(Cow::Borrowed(name)),
            [one] => Ok(Cow::Owned(one.clone())),
            many => Err(Error::invalid(format!(
                "There are {} identifiers of model '{name}' in global map, model namespace must \
                 be provided to resolve ambiguity. With --model-namespacing a model is named \
                 '<name>@<n>', n its repository's position: {}",
                many.len(),
                many.join(", ")
            ))),
        }
    }

    /// The namespace (a root's position, from 0) of a key, when namespacing is on.
    pub(super) fn namespace_of(&self, key: &str) -> Option<usize> {
        self.repository.split_key(key).map(|(_, position)| position)
    }

    /// The keys a load of `name` loads: every root's model of that name with namespacing (a
    /// name no root holds stays as it is, for the load to fail naming it). With namespacing,
    /// a name holding the mark must be a key of one of the roots.
    pub(super) fn load_keys(&self, name: &str) -> Result<Vec<String>> {
        let repository = &self.repository;
        if !repository.namespacing() {
            return Ok(vec![name.to_owned()]);
        }
        let folder = repository.split_key(name).map(|(folder, _)| folder);
        // A key names a plain folder of its repository (one a poll would find there).
        let plain = |f: &str| {
            !f.starts_with('.') && !f.contains(NAMESPACE_MARK) && ModelName::parse(f).is_ok()
        };
        if folder.is_some_and(plain) {
            return Ok(vec![name.to_owned()]);
        }
        if name.contains(NAMESPACE_MARK) {
            return Err(Error::invalid(format!(
                "invalid model name '{}': with --model-namespacing, '{NAMESPACE_MARK}' separates \
                 a model's folder name from its repository's position (1 to {})",
                name.escape_debug(),
                repository.roots().len()
            )));
        }
        let keys = repository.keys_of(name);
        Ok(if keys.is_empty() {
            vec![name.to_owned()]
        } else {
            keys
        })
    }

    /// The keys an unload of `name` unloads: every loaded model of that name with namespacing.
    pub(super) fn unload_keys(&self, name: &str) -> Result<Vec<String>> {
        if !self.repository.namespacing() || self.repository.split_key(name).is_some() {
            return Ok(vec![name.to_owned()]);
        }
        let models = self.models.read().map_err(|_| poisoned())?;
        let keys = self.loaded_keys(&models, name);
        Ok(if keys.is_empty() {
            vec![name.to_owned()]
        } else {
            keys
        })
    }

    /// The keys, one per repository, under which a model named `name` is loaded.
    fn loaded_keys(&self, models: &HashMap<String, ModelEntry>, name: &str) -> Vec<String> {
        (0..self.repository.roots().len())
            .map(|i| self.repository.key(i, name))
            .filter(|k| models.get(k).is_some_and(|e| !e.versions.is_empty()))
            .collect()
    }

    /// The key of the model that `caller`'s step (or declared call) named `name` loads: the
    /// one in the caller's own namespace, else the only one of that name in the repositories.
    ///
    /// Two rules on purpose: this one reads the repository (what a load must load with an
    /// ensemble), [`Self::step_key`] the table of loaded models (what a plan calls now);
    /// poll mode relinks an ensemble when the second changes.
    pub(super) fn composing_key(&self, caller: &str, name: &str) -> String {
        let Some(position) = self.namespace_of(caller) else {
            return name.to_owned();
        };
        let own = self.repository.key(position, name);
        if self.repository.find(&own).is_ok() {
            return own;
        }
        match self.repository.keys_of(name).as_slice() {
            [one] => one.clone(),
            // None, or several: the caller's plan then says which (not found, or ambiguous).
            _ => name.to_owned(),
        }
    }

    /// The key of the loaded model that `caller`'s step named `name` calls: the one in the
    /// caller's own namespace when it is loaded, else the request rule (the only loaded one of
    /// that name); with neither loaded, the caller's own, whose state the plan's error names.
    pub(super) fn step_key(&self, caller: &str, name: &str) -> Result<String> {
        let models = self.models.read().map_err(|_| poisoned())?;
        self.step_key_in(&models, caller, name)
    }

    /// [`Self::step_key`] with the table of models at hand.
    fn step_key_in(
        &self,
        models: &HashMap<String, ModelEntry>,
        caller: &str,
        name: &str,
    ) -> Result<String> {
        let loaded = |key: &str| models.get(key).is_some_and(|e| !e.versions.is_empty());
        let Some(position) = self.namespace_of(caller) else {
            return Ok(name.to_owned());
        };
        let own = self.repository.key(position, name);
        if loaded(&own) {
            return Ok(own);
        }
        let elsewhere = self.resolve_in(models, name)?;
        Ok(if loaded(&elsewhere) || !models.contains_key(&own) {
            elsewhere.into_owned()
        } else {
            own
        })
    }

    /// Poll mode with namespacing: the ensembles whose steps would now call other models
    /// (a model of their own namespace came or went), loaded again to call those.
    pub(super) async fn relink_ensembles(self: &Arc<Self>) {
        if !self.repository.namespacing() {
            return;
        }
        let stale: Vec<String> = match self.models.read() {
            Ok(models) => models
                .iter()
                .filter(|(key, entry)| {
                    entry.versions.values().any(|v| match &v.executor {
                        Executor::Ensemble(plan) => ensemble::composing_models(&v.config)
                            .iter()
                            .zip(plan.models())
                            .any(|((name, _), linked)| {
                                self.step_key_in(&models, key, name).ok().as_deref() != Some(linked)
                            }),
                        _ => false,
                    })
                })
                .map(|(key, _)| key.clone())
                .collect(),
            Err(_) => return,
        };
        for key in stale {
            tracing::info!(model = %key, "an ensemble's composing models changed namespace; loading it again");
            let _ = self.load_as_is(&key, Default::default()).await;
        }
    }
}
