//! Triton's logging extension (`GET`/`POST /v2/logging`, gRPC `LogSettings`): the log's levels
//! read and changed at run time by an administrator. `log_info`, `log_warning`, `log_error`
//! and `log_verbose_level` take effect at once (the binary's level filter follows
//! `log_verbose_level`, so verbose logging can be turned on for a server started without it),
//! and `log_file` / `log_format` are fixed at start: a change to them is refused by name, never
//! ignored.

use std::sync::{
    atomic::{AtomicBool, AtomicU32, Ordering::Relaxed},
    OnceLock,
};

use crate::error::{Error, Result};

/// The log's settings, read by the log's level filter on every line.
#[derive(Debug)]
pub struct LogLevels {
    info: AtomicBool,
    warning: AtomicBool,
    error: AtomicBool,
    verbose: AtomicU32,
    file: String,
    format: String,
    /// Told the new `log_verbose_level` when it changes (the binary moves its level filter).
    on_verbose: OnceLock<VerboseHook>,
}

/// What [`LogLevels::on_verbose_change`] registered.
struct VerboseHook(Box<dyn Fn(u32) + Send + Sync>);

impl std::fmt::Debug for VerboseHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("VerboseHook")
    }
}

/// A setting's value, as the protocols carry it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Setting {
    /// `log_info`, `log_warning`, `log_error`.
    Bool(bool),
    /// `log_verbose_level`.
    Uint(u32),
    /// `log_file`, `log_format`.
    Text(String),
}

static LEVELS: OnceLock<LogLevels> = OnceLock::new();

/// The setting names, in Triton's order.
pub const NAMES: [&str; 6] = [
    "log_file",
    "log_info",
    "log_warning",
    "log_error",
    "log_verbose_level",
    "log_format",
];

impl LogLevels {
    /// The settings the server started with.
    pub fn new(
        info: bool,
        warning: bool,
        error: bool,
        verbose: u32,
        file: &str,
        format: &str,
    ) -> Self {
        Self {
            info: AtomicBool::new(info),
            warning: AtomicBool::new(warning),
            error: AtomicBool::new(error),
            verbose: AtomicU32::new(verbose),
            file: file.to_owned(),
            format: format.to_owned(),
            on_verbose: OnceLock::new(),
        }
    }

    /// Calls `hook` with the new `log_verbose_level` whenever an update changes it (once
    /// registered; later registrations change nothing).
    pub fn on_verbose_change(&self, hook: impl Fn(u32) + Send + Sync + 'static) {
        let _ = self.on_verbose.set(VerboseHook(Box::new(hook)));
    }

    /// Makes these the process's settings (once, at start); later calls change nothing.
    pub fn install(self) -> &'static LogLevels {
        LEVELS.get_or_init(|| self)
    }

    /// Whether info lines are written.
    pub fn info(&self) -> bool {
        self.info.load(Relaxed)
    }

    /// Whether warnings are written.
    pub fn warning(&self) -> bool {
        self.warning.load(Relaxed)
    }

    /// Whether errors are written.
    pub fn error(&self) -> bool {
        self.error.load(Relaxed)
    }

    /// The verbose level (above 0: debug lines too).
    pub fn verbose(&self) -> u32 {
        self.verbose.load(Relaxed)
    }

    /// Every setting with its value.
    pub fn settings(&self) -> Vec<(&'static str, Setting)> {
        vec![
            ("log_file", Setting::Text(self.file.clone())),
            ("log_info", Setting::Bool(self.info())),
            ("log_warning", Setting::Bool(self.warning())),
            ("log_error", Setting::Bool(self.error())),
            ("log_verbose_level", Setting::Uint(self.verbose())),
            ("log_format", Setting::Text(self.format.clone())),
        ]
    }

    /// Applies `changes` (all checked first: one refused setting changes nothing).
    pub fn update(&self, changes: &[(String, Setting)]) -> Result<()> {
        for (name, value) in changes {
            self.check(name, value)?;
        }
        for (name, value) in changes {
            match (name.as_str(), value) {
                ("log_info", Setting::Bool(b)) => self.info.store(*b, Relaxed),
                ("log_warning", Setting::Bool(b)) => self.warning.store(*b, Relaxed),
                ("log_error", Setting::Bool(b)) => self.error.store(*b, Relaxed),
                ("log_verbose_level", Setting::Uint(n)) => {
                    let before = self.verbose.swap(*n, Relaxed);
                    match self.on_verbose.get() {
                        Some(hook) if before != *n => (hook.0)(*n),
                        _ => {}
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn check(&self, name: &str, value: &Setting) -> Result<()> {
        let wrong = |what: &str| {
            Err(Error::invalid(format!(
                "log setting '{name}' must be {what}"
            )))
        };
        match (name, value) {
            ("log_info" | "log_warning" | "log_error", Setting::Bool(_)) => Ok(()),
            ("log_info" | "log_warning" | "log_error", _) => wrong("a boolean"),
            ("log_verbose_level", Setting::Uint(_)) => Ok(()),
            ("log_verbose_level", _) => wrong("an unsigned integer"),
            ("log_file" | "log_format", Setting::Text(t)) => {
                let current = if name == "log_file" {
                    &self.file
                } else {
                    &self.format
                };
                if t == current {
                    Ok(())
                } else {
                    Err(Error::invalid(format!(
                        "log setting '{name}' is fixed at start here (restart with --{}); it is \
                         \"{current}\"",
                        name.replace('_', "-")
                    )))
                }
            }
            ("log_file" | "log_format", _) => wrong("a string"),
            _ => Err(Error::invalid(format!(
                "unknown log setting '{name}' (known: {})",
                NAMES.join(", ")
            ))),
        }
    }
}

/// The process's settings: those installed at start, else every level on (a library caller
/// that installed none).
pub fn levels() -> &'static LogLevels {
    LEVELS.get_or_init(|| LogLevels::new(true, true, true, 0, "", "default"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_change_at_once_and_fixed_settings_are_refused_by_name() {
        let l = LogLevels::new(true, true, true, 0, "", "default");
        l.update(&[("log_info".into(), Setting::Bool(false))])
            .unwrap();
        assert!(!l.info() && l.warning());
        let e = l
            .update(&[
                ("log_error".into(), Setting::Bool(false)),
                ("log_file".into(), Setting::Text("/tmp/x".into())),
            ])
            .unwrap_err();
        assert!(
            e.message.contains("'log_file' is fixed at start"),
            "{}",
            e.message
        );
        // Nothing of a refused update is applied.
        assert!(l.error());
        // Verbose lines can be turned on whatever the server started with.
        l.update(&[("log_verbose_level".into(), Setting::Uint(1))])
            .unwrap();
        assert_eq!(l.verbose(), 1);
        let e = l
            .update(&[("log_colour".into(), Setting::Bool(true))])
            .unwrap_err();
        assert!(
            e.message.contains("unknown log setting 'log_colour'"),
            "{}",
            e.message
        );
        let verbose = LogLevels::new(true, true, true, 1, "", "default");
        verbose
            .update(&[("log_verbose_level".into(), Setting::Uint(0))])
            .unwrap();
        assert_eq!(verbose.verbose(), 0);
    }
}
