//! Triton's trace files (`--trace-config triton,file=<path>`, `triton,log-frequency=<n>`; the
//! older `--trace-file`): each traced request becomes Triton's JSON trace — an object naming
//! its id, model, version and request id (and `parent_id` for an ensemble step's or a stage's
//! call), then one object per timestamp (`HTTP_RECV_START` … `REQUEST_START`, `QUEUE_START`,
//! `COMPUTE_START`, `COMPUTE_INPUT_END`, `COMPUTE_OUTPUT_START`, `COMPUTE_END`,
//! `REQUEST_END` … `HTTP_SEND_END`) and, at the `TENSORS` level, one per tensor
//! (`TENSOR_QUEUE_INPUT`, `TENSOR_BACKEND_INPUT`, `TENSOR_BACKEND_OUTPUT`) — in the form
//! Triton's `trace_summary.py` reads.
//!
//! As on Triton, each setting in force (global, or a model's) collects its own traces (a
//! [`Stream`]): with `log_frequency` 0 every trace is appended to the one file, whose JSON
//! array is closed when the server exits; with `log_frequency` N, every N traces are written
//! to `<path>.<index>`, a complete array each; a `trace_count` that runs out writes its traces
//! to the next indexed file; the rest is written when the setting changes or at exit.
//!
//! The traces are built by a `tracing` layer from the request spans on
//! [`crate::inference::TRACE_TARGET`] and the activity events [`crate::inference::Trace`]
//! records, so the request path is the same whether traces go to a file or over OTLP.

use std::{
    collections::HashMap,
    fmt::Write as _,
    fs::File,
    io::Write as _,
    path::PathBuf,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, PoisonError, Weak,
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

/// Where traces are written: the one file and its indexed siblings, shared by every setting
/// (global or a model's) in force.
#[derive(Debug)]
pub struct TraceFile {
    path: PathBuf,
    next_id: AtomicU64,
    next_stream: AtomicU64,
    state: Mutex<FileState>,
}

#[derive(Debug, Default)]
struct FileState {
    /// The next `<path>.<index>`.
    index: u64,
    /// The one file, once the first trace is written to it.
    file: Option<File>,
    finished: bool,
    /// The streams of the settings in force, by id (a trace names its stream on its span).
    streams: HashMap<u64, Weak<Stream>>,
    /// Streams of replaced settings whose traces are still running: kept until the last is
    /// written (as Triton's traces keep their setting alive).
    retired: HashMap<u64, Arc<Stream>>,
}

/// The traces of one setting in force, as Triton's `TraceSetting` collects them: with a
/// `log_frequency` of N, every N traces go to the next indexed file; a setting with a
/// `trace_count` keeps its traces until the count is used up and then writes them to an
/// indexed file; otherwise each trace is appended to the one file as it ends. What is left
/// when the setting is replaced, or at exit, is written then.
#[derive(Debug)]
pub struct Stream {
    id: u64,
    file: Arc<TraceFile>,
    log_frequency: u64,
    counted: bool,
    state: Mutex<StreamState>,
}

#[derive(Debug, Default)]
struct StreamState {
    /// Trace objects not yet written.
    pending: Vec<String>,
    traces_pending: u64,
    started: u64,
    written: u64,
    /// The setting's count is used up: no more traces will start.
    used_up: bool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl TraceFile {
    /// Traces to `path` (and `<path>.<n>`). Nothing is created until the first trace, as on
    /// Triton.
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            next_id: AtomicU64::new(1),
            next_stream: AtomicU64::new(1),
            state: Mutex::new(FileState::default()),
        }
    }

    /// The file traces go to.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// A stream for a new setting: `log_frequency` traces per indexed file (0: the one file),
    /// `counted` when the setting has a `trace_count`.
    pub fn stream(self: &Arc<Self>, log_frequency: u64, counted: bool) -> Arc<Stream> {
        let stream = Arc::new(Stream {
            id: self.next_stream.fetch_add(1, Ordering::Relaxed),
            file: self.clone(),
            log_frequency,
            counted,
            state: Mutex::new(StreamState::default()),
        });
        let mut state = lock(&self.state);
        state.streams.retain(|_, s| s.strong_count() > 0);
        state.streams.insert(stream.id, Arc::downgrade(&stream));
        stream
    }

    /// One finished request's trace objects (its own and its calls'), for the stream its
    /// setting opened; a setting replaced since appends them to the one file.
    fn write(&self, stream: u64, objects: Vec<String>) {
        if objects.is_empty() {
            return;
        }
        let live = lock(&self.state)
            .streams
            .get(&stream)
            .and_then(Weak::upgrade);
        let Some(stream) = live else {
            return self.append(&objects);
        };
        if stream.write(objects) {
            let done = lock(&self.state).retired.remove(&stream.id);
            // Dropped here, outside the lock: its rest is written.
            drop(done);
        }
    }

    /// A replaced setting's stream: written out now, or once its running traces end.
    pub fn retire(&self, stream: Arc<Stream>) {
        let running = {
            let state = lock(&stream.state);
            state.written < state.started
        };
        if running {
            lock(&self.state).retired.insert(stream.id, stream);
        }
    }

    /// Appends traces to the one file (opening its JSON array on the first).
    fn append(&self, objects: &[String]) {
        let mut state = lock(&self.state);
        if state.finished || objects.is_empty() {
            return;
        }
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
    }

    /// Writes traces to the next indexed file, a complete array.
    fn save_indexed(&self, objects: &[String]) {
        let name = {
            let mut state = lock(&self.state);
            if state.finished || objects.is_empty() {
                return;
            }
            let mut name = self.path.clone().into_os_string();
            name.push(format!(".{}", state.index));
            state.index += 1;
            name
        };
        if let Err(e) = std::fs::write(&name, format!("[{}]", objects.join(","))) {
            tracing::error!(path = ?name, "cannot write the trace file: {e}");
        }
    }

    /// At exit: every setting's remaining traces written and the one file's array closed.
    pub fn finish(&self) {
        let streams: Vec<Arc<Stream>> = lock(&self.state)
            .streams
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for stream in streams {
            stream.flush();
        }
        let mut state = lock(&self.state);
        if state.finished {
            return;
        }
        state.finished = true;
        if let Some(f) = &mut state.file {
            let _ = f.write_all(b"]").and_then(|()| f.flush());
        }
    }
}

impl Stream {
    /// The id a trace's span names.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// A trace of this setting started; `used_up` when it was the last its count allowed.
    pub fn started(&self, used_up: bool) {
        let mut state = lock(&self.state);
        state.started += 1;
        state.used_up |= used_up;
    }

    /// Collects one trace; says whether every trace started has now been written.
    fn write(&self, objects: Vec<String>) -> bool {
        let mut state = lock(&self.state);
        state.pending.extend(objects);
        state.traces_pending += 1;
        state.written += 1;
        let all_written = state.written >= state.started;
        let count_done = state.used_up && state.written >= state.started;
        let batch_full = self.log_frequency > 0 && state.traces_pending >= self.log_frequency;
        if count_done || batch_full {
            let pending = std::mem::take(&mut state.pending);
            state.traces_pending = 0;
            drop(state);
            self.file.save_indexed(&pending);
        } else if self.log_frequency == 0 && !self.counted {
            let pending = std::mem::take(&mut state.pending);
            state.traces_pending = 0;
            drop(state);
            self.file.append(&pending);
        }
        all_written
    }

    /// Writes what is left: to an indexed file with a log frequency, else to the one file.
    fn flush(&self) {
        let pending = {
            let mut state = lock(&self.state);
            state.traces_pending = 0;
            std::mem::take(&mut state.pending)
        };
        if self.log_frequency > 0 {
            self.file.save_indexed(&pending);
        } else {
            self.file.append(&pending);
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.flush();
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
    /// The stream of the setting that picked the request (0: none).
    stream: u64,
    activities: Vec<Activity>,
    /// The finished traces of the calls it made (ensemble steps, stage calls).
    children: Vec<String>,
}

/// One entry of a trace after its head: a timestamp, or a tensor (`TENSORS` level).
#[derive(Debug)]
enum Activity {
    Timestamp(String, u64),
    /// The activity (`TENSOR_QUEUE_INPUT`, …) and the tensor as Triton writes it.
    Tensor(String, String),
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
        for activity in &self.activities {
            out.push(match activity {
                Activity::Timestamp(name, ns) => format!(
                    "{{\"id\":{},\"timestamps\":[{{\"name\":{},\"ns\":{ns}}}]}}",
                    self.id,
                    json_string(name)
                ),
                Activity::Tensor(name, tensor) => format!(
                    "{{\"id\":{},\"activity\":{},\"tensor\":{tensor}}}",
                    self.id,
                    json_string(name)
                ),
            });
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
    stream: Option<u64>,
    tensor_activity: Option<String>,
    tensor: Option<String>,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let text = || format!("{value:?}").trim_matches('"').to_owned();
        match field.name() {
            "model" => self.model = Some(text()),
            "activity" => self.activity = Some(text()),
            "request_id" => self.request_id = Some(text()),
            "tensor_activity" => self.tensor_activity = Some(text()),
            _ => {}
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "model" => self.model = Some(value.to_owned()),
            "activity" => self.activity = Some(value.to_owned()),
            "request_id" => self.request_id = Some(value.to_owned()),
            "tensor_activity" => self.tensor_activity = Some(value.to_owned()),
            "tensor" => self.tensor = Some(value.to_owned()),
            _ => {}
        }
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        match field.name() {
            "ns" => self.ns = Some(value),
            "stream" => self.stream = Some(value),
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
            stream: fields.stream.unwrap_or(0),
            ..Record::default()
        };
        span.extensions_mut().insert(record);
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let Some(span) = ctx.event_span(event) else {
            return;
        };
        for s in span.scope() {
            let mut ext = s.extensions_mut();
            if let Some(record) = ext.get_mut::<Record>() {
                if let Some(activity) = fields.activity {
                    let ns = fields
                        .ns
                        .unwrap_or_else(|| crate::inference::trace_ns(std::time::Instant::now()));
                    record.activities.push(Activity::Timestamp(activity, ns));
                }
                if let (Some(activity), Some(tensor)) = (fields.tensor_activity, fields.tensor) {
                    record.activities.push(Activity::Tensor(activity, tensor));
                }
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
        let mut objects = Vec::with_capacity(2 + record.activities.len());
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
        self.0.write(record.stream, objects);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    #[test]
    fn a_request_and_its_step_become_tritons_trace_objects() {
        let dir = tempfile::tempdir().unwrap();
        let file = Arc::new(TraceFile::new(dir.path().join("trace.json")));
        let subscriber = tracing_subscriber::registry().with(TraceFileLayer(file.clone()));
        tracing::subscriber::with_default(subscriber, || {
            let root = crate::inference::Trace(
                tracing::info_span!(target: "wasmtron::trace", "infer", model = "ens"),
                crate::inference::TraceLevel {
                    timestamps: true,
                    tensors: true,
                },
            );
            root.mark("HTTP_RECV_START");
            root.tensors(
                "TENSOR_QUEUE_INPUT",
                &[crate::tensor::Tensor {
                    name: "IN".into(),
                    datatype: crate::tensor::DataType::Int64,
                    shape: vec![2],
                    data: [7i64, 8].iter().flat_map(|v| v.to_le_bytes()).collect(),
                }],
            );
            root.start(1, "req-7", std::time::Instant::now());
            {
                let step = root.child(crate::trace_span!(
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
        assert!(traces.contains(&serde_json::json!(
            {"id": 1, "activity": "TENSOR_QUEUE_INPUT",
             "tensor": {"name": "IN", "data": "7,8", "shape": "2", "dtype": "INT64"}}
        )));
    }

    #[test]
    fn with_a_log_frequency_every_n_traces_make_an_indexed_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = Arc::new(TraceFile::new(dir.path().join("t.json")));
        let stream = file.stream(2, false);
        for i in 0..3 {
            stream.started(false);
            file.write(stream.id(), vec![format!("{{\"id\":{i}}}")]);
        }
        assert!(dir.path().join("t.json.0").exists());
        assert!(!dir.path().join("t.json.1").exists());
        file.finish();
        let last = std::fs::read_to_string(dir.path().join("t.json.1")).unwrap();
        assert_eq!(last, "[{\"id\":2}]");
    }

    #[test]
    fn a_used_up_count_writes_an_indexed_file_and_a_replaced_setting_its_rest() {
        let dir = tempfile::tempdir().unwrap();
        let file = Arc::new(TraceFile::new(dir.path().join("t.json")));
        // Unlimited, no frequency: appended to the one file as they end.
        let open = file.stream(0, false);
        open.started(false);
        file.write(open.id(), vec!["{\"id\":1}".to_owned()]);
        // A count of 2: kept until both are written, then an indexed file.
        let counted = file.stream(0, true);
        counted.started(false);
        file.write(counted.id(), vec!["{\"id\":2}".to_owned()]);
        assert!(!dir.path().join("t.json.0").exists());
        counted.started(true);
        file.write(counted.id(), vec!["{\"id\":3}".to_owned()]);
        let indexed = std::fs::read_to_string(dir.path().join("t.json.0")).unwrap();
        assert_eq!(indexed, "[{\"id\":2},{\"id\":3}]");
        // A setting replaced while its traces run: what it kept goes to the one file, and a
        // trace ending afterwards too.
        let replaced = file.stream(0, true);
        replaced.started(false);
        file.write(replaced.id(), vec!["{\"id\":4}".to_owned()]);
        let id = replaced.id();
        drop(replaced);
        file.write(id, vec!["{\"id\":5}".to_owned()]);
        file.finish();
        let one = std::fs::read_to_string(dir.path().join("t.json")).unwrap();
        assert_eq!(one, "[{\"id\":1},{\"id\":4},{\"id\":5}]");
    }

    #[test]
    fn a_replaced_setting_waits_for_its_running_traces() {
        let dir = tempfile::tempdir().unwrap();
        let file = Arc::new(TraceFile::new(dir.path().join("t.json")));
        let stream = file.stream(2, false);
        let id = stream.id();
        for i in 0..3 {
            stream.started(false);
            if i < 2 {
                file.write(id, vec![format!("{{\"id\":{i}}}")]);
            }
        }
        // Replaced while its third trace runs: that trace still goes to its indexed file.
        file.retire(stream);
        assert!(!dir.path().join("t.json.1").exists());
        file.write(id, vec!["{\"id\":2}".to_owned()]);
        let rest = std::fs::read_to_string(dir.path().join("t.json.1")).unwrap();
        assert_eq!(rest, "[{\"id\":2}]");
        assert!(!dir.path().join("t.json").exists());
    }
}
