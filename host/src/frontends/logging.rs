//! Triton's logging extension (`GET`/`POST /v2/logging`, gRPC `LogSettings`): the log's levels
//! read and changed at run time by an administrator. `log_info`, `log_warning`, `log_error`,
//! `log_verbose_level` and `log_format` take effect at once (the binary's level filter follows
//! `log_verbose_level`, so verbose logging can be turned on for a server started without it),
//! and `log_file` is fixed at start: a change to it is refused in Triton's words, never ignored.

use std::sync::{
    atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering::Relaxed},
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
    /// A [`LineFormat`], as a number.
    format: AtomicU8,
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

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineFormat {
    /// The server's own lines (reported as `default`), when no `--log-format` was given.
    Own,
    /// Triton's `default` lines: `I1127 06:35:03.744354 <pid> <file>:<line>] <message>`.
    Triton,
    /// Triton's `ISO8601` lines: `2026-11-27T06:35:03Z I <pid> <file>:<line>] <message>`.
    TritonIso8601,
}

impl LineFormat {
    /// The name the logging extension reports.
    pub fn name(self) -> &'static str {
        match self {
            LineFormat::Own | LineFormat::Triton => "default",
            LineFormat::TritonIso8601 => "ISO8601",
        }
    }

    fn code(self) -> u8 {
        self as u8
    }

    fn from_code(code: u8) -> Self {
        match code {
            1 => LineFormat::Triton,
            2 => LineFormat::TritonIso8601,
            _ => LineFormat::Own,
        }
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
        format: LineFormat,
    ) -> Self {
        Self {
            info: AtomicBool::new(info),
            warning: AtomicBool::new(warning),
            error: AtomicBool::new(error),
            verbose: AtomicU32::new(verbose),
            file: file.to_owned(),
            format: AtomicU8::new(format.code()),
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

    /// How lines are written now.
    pub fn format(&self) -> LineFormat {
        LineFormat::from_code(self.format.load(Relaxed))
    }

    /// Every setting with its value.
    pub fn settings(&self) -> Vec<(&'static str, Setting)> {
        vec![
            ("log_file", Setting::Text(self.file.clone())),
            ("log_info", Setting::Bool(self.info())),
            ("log_warning", Setting::Bool(self.warning())),
            ("log_error", Setting::Bool(self.error())),
            ("log_verbose_level", Setting::Uint(self.verbose())),
            ("log_format", Setting::Text(self.format().name().to_owned())),
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
                // Triton's lines in the format asked for (a server writing its own lines
                // switches to Triton's).
                ("log_format", Setting::Text(t)) => {
                    let format = if t == "ISO8601" {
                        LineFormat::TritonIso8601
                    } else {
                        LineFormat::Triton
                    };
                    if format.name() != self.format().name() {
                        self.format.store(format.code(), Relaxed);
                    }
                }
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
            ("log_file", Setting::Text(t)) if *t == self.file => Ok(()),
            // Triton's words (its scripts match them), then where the file is set.
            ("log_file", Setting::Text(_)) => Err(Error::invalid(format!(
                "log file location can not be updated through network protocol (it is fixed \
                 at start with --log-file: \"{}\")",
                self.file
            ))),
            ("log_format", Setting::Text(t)) if t == "default" || t == "ISO8601" => Ok(()),
            ("log_format", Setting::Text(t)) => Err(Error::invalid(format!(
                "invalid argument for --log_format, got: {t} (default or ISO8601)"
            ))),
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
    LEVELS.get_or_init(|| LogLevels::new(true, true, true, 0, "", LineFormat::Own))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_change_at_once_and_the_file_is_refused_in_tritons_words() {
        let l = LogLevels::new(true, true, true, 0, "", LineFormat::Own);
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
            e.message
                .starts_with("log file location can not be updated through network protocol"),
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
        // The format changes at once: the server's own lines become Triton's when asked.
        assert_eq!(l.format(), LineFormat::Own);
        l.update(&[("log_format".into(), Setting::Text("ISO8601".into()))])
            .unwrap();
        assert_eq!(l.format(), LineFormat::TritonIso8601);
        l.update(&[("log_format".into(), Setting::Text("default".into()))])
            .unwrap();
        assert_eq!(l.format(), LineFormat::Triton);
        let e = l
            .update(&[("log_format".into(), Setting::Text("json".into()))])
            .unwrap_err();
        assert!(e
            .message
            .contains("invalid argument for --log_format, got: json"));
        let verbose = LogLevels::new(true, true, true, 1, "", LineFormat::Triton);
        verbose
            .update(&[("log_verbose_level".into(), Setting::Uint(0))])
            .unwrap();
        assert_eq!(verbose.verbose(), 0);
    }
}
