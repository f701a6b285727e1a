//! Who may change the set of loaded models: loads and unloads asked for by a caller are
//! checked here, once, for every frontend and the in-process package.

use super::{LoadOverride, ModelManager};
use crate::{
    error::{Error, Result},
    names::ModelName,
    tenancy::{Caller, ModelAction},
};

impl ModelManager {
    /// Whether `caller` may load `model` as asked. A configuration or files in the request are for
    /// administrators: they could make an ensemble of other tenants' models or run any stage. An
    /// ensemble's load also loads the composing models that are not loaded yet: the caller must be
    /// allowed to load each of them too.
    pub fn check_load(&self, caller: &Caller, model: &str, overrides: &LoadOverride) -> Result<()> {
        ModelName::parse(model)?;
        // An adapter (weights only, checked as read) is the base model's to load.
        if self.adapter_ref(model).is_some() {
            return caller.require(ModelAction::Load, self.rights_name(model));
        }
        caller.require(ModelAction::Load, model)?;
        if overrides.config_json.is_some() || !overrides.files.is_empty() {
            caller.require_admin("load with a configuration or files")?;
        }
        if !matches!(caller, Caller::Tenant(_)) {
            return Ok(());
        }
        for composing in self.would_also_load(model, overrides) {
            caller.require(ModelAction::Load, &composing).map_err(|e| {
                Error::new(
                    e.code,
                    format!(
                        "loading ensemble '{model}' would load '{composing}', which this key may not                      load: {}",
                        e.message
                    ),
                )
            })?;
        }
        Ok(())
    }

    /// Whether `caller` may unload `model` as asked; `unload_dependents` (which unloads the models
    /// an ensemble calls, whoever's they are) is for administrators.
    pub fn check_unload(
        &self,
        caller: &Caller,
        model: &str,
        unload_dependents: bool,
    ) -> Result<()> {
        ModelName::parse(model)?;
        caller.require(ModelAction::Load, self.rights_name(model))?;
        if unload_dependents {
            caller.require_admin("unload_dependents")?;
        }
        Ok(())
    }

    /// The model whose rights cover loading and unloading `name`: the model itself, or for
    /// `model:adapter` the model.
    pub fn rights_name<'a>(&self, name: &'a str) -> &'a str {
        self.adapter_ref(name).map_or(name, |(model, _)| model)
    }
}
