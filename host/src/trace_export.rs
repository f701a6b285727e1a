//! Logging and trace export at the binary's edge: Triton's `--trace-config` flags, and the
//! `tracing` subscriber (the log on stderr, plus, in an `otel` build with
//! `--trace-config mode=opentelemetry`, request spans exported over OTLP/HTTP).

use anyhow::{bail, Context};
use tracing_subscriber::{layer::SubscriberExt, util::SubscriberInitExt};
use wasmtron::{
    frontends::{
        trace::Tracing,
        trace_file::{TraceFile, TraceFileLayer},
    },
    inference::TRACE_TARGET,
};

/// What `--trace-config` asked for.
#[derive(Debug, Default)]
pub struct TraceOptions {
    /// `mode=opentelemetry`.
    pub opentelemetry: bool,
    /// `opentelemetry,url=...` (Triton's default: localhost:4318/v1/traces).
    pub url: Option<String>,
    /// `opentelemetry,resource=key=value`, repeatable.
    pub resource: Vec<(String, String)>,
    /// `opentelemetry,bsp_schedule_delay=MS`: how long spans wait to be sent in a batch.
    pub schedule_delay_ms: Option<u64>,
    /// `level=`, `rate=`, `count=`: the initial trace settings.
    pub settings: Vec<(String, String)>,
    /// `triton,file=PATH` (or `--trace-file`): Triton's trace file.
    pub file: Option<std::path::PathBuf>,
    /// `triton,log-frequency=N` (or `--trace-log-frequency`): traces per indexed file.
    pub log_frequency: u64,
    /// `mode=triton` was given.
    pub triton_mode: bool,
}

/// Parses `--trace-config` values the way Triton writes them: `setting=value`, or
/// `opentelemetry,setting=value` for the exporter.
pub fn parse(entries: &[String]) -> anyhow::Result<TraceOptions> {
    let mut options = TraceOptions::default();
    for entry in entries {
        let (section, setting) = match entry.split_once(',') {
            Some((section, rest)) if !section.contains('=') => (Some(section), rest),
            _ => (None, entry.as_str()),
        };
        let (key, value) = setting
            .split_once('=')
            .with_context(|| format!("--trace-config {entry}: expected setting=value"))?;
        match (section, key) {
            (None, "mode") => match value {
                "opentelemetry" => options.opentelemetry = true,
                "triton" => options.triton_mode = true,
                other => bail!("--trace-config mode={other}: use triton or opentelemetry"),
            },
            (None, "level" | "rate" | "count") => {
                options.settings.push((key.to_owned(), value.to_owned()))
            }
            (None | Some("triton"), "file") => {
                if value.is_empty() {
                    bail!("--trace-config {entry}: the trace file needs a path");
                }
                options.file = Some(value.into());
            }
            (None | Some("triton"), "log-frequency" | "log_frequency") => {
                options.log_frequency = value.parse().with_context(|| {
                    format!("--trace-config {entry}: a number of traces expected")
                })?
            }
            (Some("opentelemetry"), "url") => options.url = Some(value.to_owned()),
            (Some("opentelemetry"), "resource") => {
                let (k, v) = value.split_once('=').with_context(|| {
                    format!("--trace-config {entry}: expected resource=key=value")
                })?;
                options.resource.push((k.to_owned(), v.to_owned()));
            }
            (Some("opentelemetry"), "bsp_schedule_delay") => {
                options.schedule_delay_ms =
                    Some(value.parse().with_context(|| {
                        format!("--trace-config {entry}: milliseconds expected")
                    })?)
            }
            _ => bail!(
                "--trace-config {entry}: unknown setting (mode, level, rate, count, \
                 opentelemetry,url=, opentelemetry,resource=, opentelemetry,bsp_schedule_delay=, \
                 triton,file=, triton,log-frequency=)"
            ),
        }
    }
    if options.opentelemetry && (options.triton_mode || options.file.is_some()) {
        bail!(
            "--trace-config: mode=opentelemetry exports traces over OTLP; a trace file \
             (triton,file=) is Triton's other mode: choose one"
        );
    }
    Ok(options)
}

/// Flushes exported spans, or the trace file, at exit.
pub struct Exporter {
    #[cfg(feature = "otel")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
    file: Option<std::sync::Arc<TraceFile>>,
}

impl Exporter {
    /// Sends what is still buffered, or writes the rest of the trace file; called once the
    /// server has drained.
    pub fn shutdown(self) {
        #[cfg(feature = "otel")]
        if let Some(provider) = self.provider {
            if let Err(e) = provider.shutdown() {
                tracing::warn!("trace export did not finish: {e}");
            }
        }
        if let Some(file) = self.file {
            file.finish();
        }
    }
}

/// Installs the subscriber: the log at `level` (`RUST_LOG` overrides) without the request
/// spans, shaped by the log flags, and the OTLP exporter for them when asked. Returns the request tracing settings and
/// the exporter to shut down at exit.
pub fn init(
    level: &'static str,
    log: &crate::log_lines::LogOptions,
    options: &TraceOptions,
) -> anyhow::Result<(Tracing, Option<Exporter>)> {
    // RUST_LOG, when set, decides for good; otherwise the level follows log_verbose_level
    // (debug lines only while it is above 0, so that they cost nothing the rest of the time).
    let from_env = std::env::var_os("RUST_LOG").is_some();
    let filter_for = move |verbose: Option<u32>| -> tracing_subscriber::EnvFilter {
        let level = match verbose {
            Some(0) => "info",
            Some(_) => "debug",
            None => level,
        };
        let base = if from_env {
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| format!("{level},ort=warn").into())
        } else {
            format!("{level},ort=warn").into()
        };
        match format!("{TRACE_TARGET}=off").parse() {
            Ok(off) => base.add_directive(off),
            Err(_) => base,
        }
    };
    let log = crate::log_lines::layer(log, filter_for, !from_env)?;
    let registry = tracing_subscriber::registry().with(log);
    if let Some(path) = &options.file {
        use tracing_subscriber::Layer;
        let file = std::sync::Arc::new(TraceFile::new(path.clone()));
        let layer = TraceFileLayer(file.clone()).with_filter(
            tracing_subscriber::filter::Targets::new()
                .with_target(TRACE_TARGET, tracing::Level::INFO),
        );
        registry.with(layer).init();
        tracing::info!(file = %path.display(), "writing request traces as Triton's trace files");
        let exporter = Exporter {
            #[cfg(feature = "otel")]
            provider: None,
            file: Some(file.clone()),
        };
        return Ok((
            Tracing::to_file(file, options.log_frequency),
            Some(exporter),
        ));
    }
    if !options.opentelemetry {
        registry.init();
        let on = options
            .settings
            .iter()
            .any(|(k, v)| k == "level" && !v.eq_ignore_ascii_case("off"));
        if on {
            // As on Triton, traces need somewhere to go: say so instead of tracing nothing.
            tracing::warn!(
                "--trace-config level: no request is traced without a trace file \
                 (--trace-config triton,file=PATH) or mode=opentelemetry"
            );
        }
        return Ok((Tracing::new(false), None));
    }
    #[cfg(feature = "otel")]
    {
        use opentelemetry::trace::TracerProvider;
        use opentelemetry_otlp::WithExportConfig;
        use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor};
        use tracing_subscriber::Layer;

        let url = options
            .url
            .clone()
            .unwrap_or_else(|| "http://localhost:4318/v1/traces".to_owned());
        let url = if url.contains("://") {
            url
        } else {
            format!("http://{url}")
        };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(url.clone())
            .build()
            .with_context(|| format!("--trace-config opentelemetry,url={url}"))?;
        let mut batch = BatchConfigBuilder::default();
        if let Some(ms) = options.schedule_delay_ms {
            batch = batch.with_scheduled_delay(std::time::Duration::from_millis(ms));
        }
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(batch.build())
            .build();
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name("wasmtron")
            .with_attributes(
                options
                    .resource
                    .iter()
                    .map(|(k, v)| opentelemetry::KeyValue::new(k.clone(), v.clone())),
            )
            .build();
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource)
            .build();
        let spans = tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("wasmtron"))
            .with_filter(
                tracing_subscriber::filter::Targets::new()
                    .with_target(TRACE_TARGET, tracing::Level::INFO),
            );
        registry.with(spans).init();
        tracing::info!(endpoint = %url, "exporting request traces over OTLP/HTTP");
        Ok((
            Tracing::new(true),
            Some(Exporter {
                provider: Some(provider),
                file: None,
            }),
        ))
    }
    #[cfg(not(feature = "otel"))]
    {
        drop(registry);
        bail!(
            "--trace-config mode=opentelemetry: this wasmtron build has no OpenTelemetry \
             support (rebuild with `--features otel`)"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn triton_forms_parse_and_mistakes_are_named() {
        let o = parse(&args(&[
            "mode=opentelemetry",
            "level=TIMESTAMPS",
            "rate=1",
            "opentelemetry,url=127.0.0.1:4318/v1/traces",
            "opentelemetry,resource=deployment=test",
        ]))
        .unwrap();
        assert!(o.opentelemetry);
        assert_eq!(o.url.as_deref(), Some("127.0.0.1:4318/v1/traces"));
        assert_eq!(o.resource, [("deployment".to_owned(), "test".to_owned())]);
        assert_eq!(o.settings.len(), 2);
        let t = parse(&args(&[
            "triton,file=/tmp/t.json",
            "triton,log-frequency=50",
            "level=TIMESTAMPS",
        ]))
        .unwrap();
        assert_eq!(t.file.as_deref(), Some(std::path::Path::new("/tmp/t.json")));
        assert_eq!(t.log_frequency, 50);
        for (bad, says) in [
            ("mode=sideways", "use triton or opentelemetry"),
            ("triton,file=", "needs a path"),
            ("opentelemetry,colour=red", "unknown setting"),
            ("level", "setting=value"),
        ] {
            let err = parse(&args(&[bad])).unwrap_err().to_string();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}
