//! The log as Triton's flags shape it: which levels are written (`--log-verbose`,
//! `--log-info`, `--log-warning`, `--log-error`), where (`--log-file`, else the standard
//! error) and how: the server's own structured lines, or Triton's (`--log-format default`:
//! `I1127 06:35:03.744354 <pid> <file>:<line>] "<message>" <fields>`; `--log-format ISO8601`:
//! `2026-11-27T06:35:03Z I <pid> <file>:<line>] "<message>" <fields>`), in UTC.

use std::{
    fmt::{self, Write as _},
    fs::OpenOptions,
    path::PathBuf,
    sync::Mutex,
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::Context;
use tracing::{field::Field, Event, Level, Subscriber};
use tracing_subscriber::{
    filter::{dynamic_filter_fn, EnvFilter},
    fmt::{format::Writer, FmtContext, FormatEvent, FormatFields},
    registry::LookupSpan,
    Layer,
};

use wasmtron::frontends::logging::{LineFormat, LogLevels};

use crate::command_line::LogFormat;

/// What the log flags asked for.
#[derive(Debug, Clone)]
pub struct LogOptions {
    /// `--log-verbose`: above 0, debug lines too.
    pub verbose: u32,
    /// `--log-info`.
    pub info: bool,
    /// `--log-warning`.
    pub warning: bool,
    /// `--log-error`.
    pub error: bool,
    /// `--log-format`: Triton's lines; `None`, the server's own.
    pub format: Option<LogFormat>,
    /// `--log-file`: appended to instead of the standard error.
    pub file: Option<PathBuf>,
}

/// The log layer: `filter_for(None)` (what `RUST_LOG` or the starting level allows) narrowed
/// by the level flags, written where and as the options say. With `follow_verbose`, the filter
/// becomes `filter_for(Some(level))` whenever the logging extension changes
/// `log_verbose_level`, so debug lines can be turned on at run time without costing anything
/// while they are off.
pub fn layer<S>(
    options: &LogOptions,
    filter_for: impl Fn(Option<u32>) -> EnvFilter + Send + Sync + 'static,
    follow_verbose: bool,
) -> anyhow::Result<Box<dyn Layer<S> + Send + Sync + 'static>>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    // The levels can change at run time through the logging extension: read on every line.
    let format = match options.format {
        Some(LogFormat::Iso8601) => LineFormat::TritonIso8601,
        Some(LogFormat::Default) => LineFormat::Triton,
        None => LineFormat::Own,
    };
    let file_name = options
        .file
        .as_ref()
        .map(|f| f.display().to_string())
        .unwrap_or_default();
    let settings = LogLevels::new(
        options.info,
        options.warning,
        options.error,
        options.verbose,
        &file_name,
        format,
    )
    .install();
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter_for(None));
    if follow_verbose {
        settings.on_verbose_change(move |verbose| {
            if let Err(e) = handle.reload(filter_for(Some(verbose))) {
                eprintln!("cannot change the log level: {e}");
            }
        });
    }
    // Asked on every line (a dynamic filter): a plain filter function's answer is cached
    // per call site.
    let levels = dynamic_filter_fn(move |meta, _| match *meta.level() {
        Level::ERROR => settings.error(),
        Level::WARN => settings.warning(),
        Level::INFO => settings.info(),
        _ => settings.verbose() > 0,
    });
    let file = match &options.file {
        Some(path) => Some(Mutex::new(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("--log-file {}", path.display()))?,
        )),
        None => None,
    };
    let ansi = file.is_none() && std::io::IsTerminal::is_terminal(&std::io::stderr());
    // The logging extension may change the format at run time: read on every line.
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .event_format(Lines {
            settings,
            own: tracing_subscriber::fmt::format::Format::default(),
        });
    Ok(match file {
        None => fmt
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .with_filter(levels)
            .boxed(),
        Some(file) => fmt
            .with_writer(file)
            .with_filter(filter)
            .with_filter(levels)
            .boxed(),
    })
}

/// The log's lines: the server's own, or Triton's in the format the settings hold now.
struct Lines {
    settings: &'static LogLevels,
    own: tracing_subscriber::fmt::format::Format,
}

impl<S, N> FormatEvent<S, N> for Lines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let iso = match self.settings.format() {
            LineFormat::Own => return self.own.format_event(ctx, writer, event),
            LineFormat::Triton => false,
            LineFormat::TritonIso8601 => true,
        };
        let meta = event.metadata();
        let severity = match *meta.level() {
            Level::ERROR => 'E',
            Level::WARN => 'W',
            Level::INFO => 'I',
            _ => 'V',
        };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let (date, time) = utc(now.as_secs());
        let pid = std::process::id();
        let file = meta
            .file()
            .and_then(|f| f.rsplit('/').next())
            .unwrap_or(meta.target());
        let line = meta.line().unwrap_or(0);
        if !iso {
            write!(
                writer,
                "{severity}{:02}{:02} {:02}:{:02}:{:02}.{:06} {pid} {file}:{line}] ",
                date.1,
                date.2,
                time.0,
                time.1,
                time.2,
                now.subsec_micros()
            )?;
        } else {
            write!(
                writer,
                "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z {severity} {pid} {file}:{line}] ",
                date.0, date.1, date.2, time.0, time.1, time.2
            )?;
        }
        let mut fields = Fields::default();
        event.record(&mut fields);
        write!(writer, "{:?}", fields.message)?;
        writeln!(writer, "{}", fields.rest)
    }
}

/// An event's message and its other fields as ` key=value`.
#[derive(Default)]
struct Fields {
    message: String,
    rest: String,
}

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.rest, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.rest, " {}={value}", field.name());
        }
    }
}

/// The UTC date (year, month, day) and time (hour, minute, second) of Unix seconds.
fn utc(secs: u64) -> ((i64, u32, u32), (u64, u64, u64)) {
    let days = (secs / 86_400) as i64;
    let of_day = secs % 86_400;
    // Days to the civil date (proleptic Gregorian), from March-based years.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (
        (year, month, day),
        (of_day / 3_600, of_day % 3_600 / 60, of_day % 60),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_seconds_become_utc_dates() {
        assert_eq!(utc(0), ((1970, 1, 1), (0, 0, 0)));
        // 2026-11-27T06:35:03Z
        assert_eq!(utc(1_795_761_303), ((2026, 11, 27), (6, 35, 3)));
        // 2024-02-29T23:59:59Z (a leap day)
        assert_eq!(utc(1_709_251_199), ((2024, 2, 29), (23, 59, 59)));
    }
}
