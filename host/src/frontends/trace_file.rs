//! Triton's trace files (`--trace-config triton,file=<path>`, `triton,log-frequency=<n>`; the
//! older `--trace-file`): each traced request becomes Triton's JSON trace — an object naming
//! its id, model, version and request id (and `parent_id` for an ensemble step's or a stage's
//! call), then one object per timestamp (`HTTP_RECV_START` … `REQUEST_START`, `QUEUE_START`,
//! `COMPUTE_START`, `COMPUTE_INPUT_END`, `COMPUTE_OUTPUT_START`, `COMPUTE_END`,
//! `REQUEST_END` … `HTTP_SEND_END`) — in the form Triton's `trace_summary.py` reads.
//!
//! As on Triton: with `log-frequency` 0 every trace is appended to the one file, whose JSON
//! array is closed when the server exits; with `log-frequency` N, every N traces are written
//! to `<path>.<index>`, a complete array each, and the rest at exit.
//!
//! The traces are built by a `tracing` layer from the request spans on
//! [`crate::inference::TRACE_TARGET`] and the activity events [`crate::inference::Trace`]
//! records, so the request path is the same whether traces go to a file or over OTLP.

use std::{
    fmt::Write as _,
    fs::File,
    io::Write as _,
    path::PathBuf,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, PoisonError,
    },
};

use tracing::{
    field::{Field, Visit},
    span, Event, Subscriber,
};
use tracing_subscriber::{layer::Context, registry::LookupSpan, Layer};

/// Spans that stand for a request (and so for one Triton trace): the frontends' requests,
/// ensemble steps, and the calls stages make.
const REQUEST_SPANS: [&str; 4] = ["infer", "ensemble.step", "stage.call", "python.call"];

/// Where traces are written and how often.
#[derive(Debug)]
pub struct TraceFile {
    path: PathBuf,
    log_frequency: u64,
    next_id: AtomicU64,
    state: Mutex<FileState>,
}

#[derive(Debug, Default)]
struct FileState {
    /// Traces not yet written (with `log_frequency` > 0), as JSON objects.
    pending: Vec<String>,
    traces_pending: u64,
    /// The next `<path>.<index>`.
    index: u64,
    /// The one file (`log_frequency` 0), once the first trace is written.
    file: Option<File>,
    finished: bool,
}

impl TraceFile {
    /// Traces to `path`, `log_frequency` at a time (0: one growing file). Nothing is created
    /// until the first trace, as on Triton.
    pub fn new(path: PathBuf, log_frequency: u64) -> Self {
        Self {
            path,
            log_frequency,
            next_id: AtomicU64::new(1),
            state: Mutex::new(FileState::default()),
        }
    }

    /// The file traces go to.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// How many traces each indexed file holds (0: one file).
    pub fn log_frequency(&self) -> u64 {
        self.log_frequency
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FileState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One finished request's trace objects (its own and its calls').
    fn write(&self, objects: Vec<String>) {
        if objects.is_empty() {
            return;
        }
        let mut state = self.lock();
        if state.finished {
            return;
        }
        if self.log_frequency == 0 {
            let result = match &mut state.file {
                Some(f) => write!(f, ",{}", objects.join(",")),
                None => match File::create(&self.path) {
                    Ok(mut f) => {
                        let written = write!(f, "[{}", objects.join(","));
                        state.file = Some(f);
                        written
                    }
                    Err(e) => Err(e),
                },
            };
            if let Err(e) = result {
                tracing::error!(path = %self.path.display(), "cannot write the trace file: {e}");
            }
            return;
        }
        state.pending.extend(objects);
        state.traces_pending += 1;
        if state.traces_pending >= self.log_frequency {
            self.flush(&mut state);
        }
    }

    /// Writes the pending traces to the next indexed file.
    fn flush(&self, state: &mut FileState) {
        if state.pending.is_empty() {
            return;
        }
        let mut name = self.path.clone().into_os_string();
        name.push(format!(".{}", state.index));
        state.index += 1;
        let text = format!("[{}]", state.pending.join(","));
        state.pending.clear();
        state.traces_pending = 0;
        if let Err(e) = std::fs::write(&name, text) {
            tracing::error!(path = ?name, "cannot write the trace file: {e}");
        }
    }

    /// At exit: the rest of the traces written and the one file's array closed.
    pub fn finish(&self) {
        let mut state = self.lock();
        if state.finished {
            return;
        }
        state.finished = true;
        if self.log_frequency > 0 {
            self.flush(&mut state);
        } else if let Some(f) = &mut state.file {
            let _ = f.write_all(b"]").and_then(|()| f.flush());
        }
    }
}

/// One request's trace, kept on its span while the request runs.
#[derive(Debug, Default)]
struct Record {
    id: u64,
    parent: Option<u64>,
    model: String,
    version: Option<i64>,
    request_id: String,
    timestamps: Vec<(String, u64)>,
    /// The finished traces of the calls it made (ensemble steps, stage calls).
    children: Vec<String>,
}

impl Record {
    fn to_objects(&self, out: &mut Vec<String>) {
        let mut head = format!(
            "{{\"id\":{},\"model_name\":{},\"model_version\":{}",
            self.id,
            json_string(&self.model),
            self.version.unwrap_or(-1)
        );
        if !self.request_id.is_empty() {
            let _ = write!(head, ",\"request_id\":{}", json_string(&self.request_id));
        }
        if let Some(parent) = self.parent {
            let _ = write!(head, ",\"parent_id\":{parent}");
        }
        head.push('}');
        out.push(head);
        for (name, ns) in &self.timestamps {
            out.push(format!(
                "{{\"id\":{},\"timestamps\":[{{\"name\":{},\"ns\":{ns}}}]}}",
                self.id,
                json_string(name)
            ));
        }
    }
}

fn json_string(s: &str) -> String {
    serde_json::Value::String(s.to_owned()).to_string()
}

/// Reads the fields this layer cares about from a span or an event.
#[derive(Default)]
struct Fields {
    model: Option<String>,
    activity: Option<String>,
    ns: Option<u64>,
    version: Option<i64>,
    request_id: Option<String>,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let text = || format!("{value:?}").trim_matches('"').to_owned();
        match field.name() {
            "model" => self.model = Some(text()),
            "activity" => self.activity = Some(text()),
            "request_id" => self.request_id = Some(text()),
            _ => {}
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "model" => self.model = Some(value.to_owned()),
            "activity" => self.activity = Some(value.to_owned()),
            "request_id" => self.request_id = Some(value.to_owned()),
            _ => {}
        }
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        match field.name() {
            "ns" => self.ns = Some(value),
            "version" => self.version = i64::try_from(value).ok(),
            _ => {}
        }
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        match field.name() {
            "ns" => self.ns = u64::try_from(value).ok(),
            "version" => self.version = Some(value),
            _ => {}
        }
    }
}

/// The `tracing` layer that writes Triton's trace files.
pub struct TraceFileLayer(pub Arc<TraceFile>);

impl<S> Layer<S> for TraceFileLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        if !REQUEST_SPANS.contains(&attrs.metadata().name()) {
            return;
        }
        let Some(span) = ctx.span(id) else {
            return;
        };
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        let parent = span
            .scope()
            .skip(1)
            .find_map(|s| s.extensions().get::<Record>().map(|r| r.id));
        let record = Record {
            id: self.0.next_id.fetch_add(1, Ordering::Relaxed),
            parent,
            model: fields.model.unwrap_or_default(),
            ..Record::default()
        };
        span.extensions_mut().insert(record);
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let Some(activity) = fields.activity else {
            return;
        };
        let Some(span) = ctx.event_span(event) else {
            return;
        };
        for s in span.scope() {
            let mut ext = s.extensions_mut();
            if let Some(record) = ext.get_mut::<Record>() {
                let ns = fields
                    .ns
                    .unwrap_or_else(|| crate::inference::trace_ns(std::time::Instant::now()));
                record.timestamps.push((activity, ns));
                if let Some(v) = fields.version {
                    record.version = Some(v);
                }
                if let Some(r) = fields.request_id.take() {
                    record.request_id = r;
                }
                return;
            }
        }
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else {
            return;
        };
        let Some(record) = span.extensions_mut().remove::<Record>() else {
            return;
        };
        let mut objects = Vec::with_capacity(2 + record.timestamps.len());
        record.to_objects(&mut objects);
        objects.extend(record.children);
        // A call's trace goes with its caller's, as Triton writes a request's traces together.
        let parent = span
            .scope()
            .skip(1)
            .find(|s| s.extensions().get::<Record>().is_some());
        if let Some(parent) = parent {
            if let Some(r) = parent.extensions_mut().get_mut::<Record>() {
                r.children.extend(objects);
                return;
            }
        }
        self.0.write(objects);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    #[test]
    fn a_request_and_its_step_become_tritons_trace_objects() {
        let dir = tempfile::tempdir().unwrap();
        let file = Arc::new(TraceFile::new(dir.path().join("trace.json"), 0));
        let subscriber = tracing_subscriber::registry().with(TraceFileLayer(file.clone()));
        tracing::subscriber::with_default(subscriber, || {
            let root = crate::inference::Trace(tracing::info_span!(
                target: "wasmtron::trace",
                "infer",
                model = "ens"
            ));
            root.mark("HTTP_RECV_START");
            root.start(1, "req-7", std::time::Instant::now());
            {
                let step = crate::inference::Trace(crate::trace_span!(
                    parent: &root.0,
                    "ensemble.step",
                    model = "add"
                ));
                step.start(3, "", std::time::Instant::now());
                step.mark("QUEUE_START");
            }
            root.mark("REQUEST_END");
        });
        file.finish();
        let text = std::fs::read_to_string(dir.path().join("trace.json")).unwrap();
        let traces: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
        assert_eq!(
            traces[0],
            serde_json::json!({"id": 1, "model_name": "ens", "model_version": 1,
                               "request_id": "req-7"})
        );
        let names: Vec<(u64, &str)> = traces
            .iter()
            .filter_map(|t| Some((t["id"].as_u64()?, t["timestamps"][0]["name"].as_str()?)))
            .collect();
        assert_eq!(
            names,
            [
                (1, "HTTP_RECV_START"),
                (1, "REQUEST_START"),
                (1, "REQUEST_END"),
                (2, "REQUEST_START"),
                (2, "QUEUE_START")
            ]
        );
        assert!(traces.contains(&serde_json::json!(
            {"id": 2, "model_name": "add", "model_version": 3, "parent_id": 1}
        )));
    }

    #[test]
    fn with_a_log_frequency_every_n_traces_make_an_indexed_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = TraceFile::new(dir.path().join("t.json"), 2);
        for i in 0..3 {
            file.write(vec![format!("{{\"id\":{i}}}")]);
        }
        assert!(dir.path().join("t.json.0").exists());
        assert!(!dir.path().join("t.json.1").exists());
        file.finish();
        let last = std::fs::read_to_string(dir.path().join("t.json.1")).unwrap();
        assert_eq!(last, "[{\"id\":2}]");
    }
}
