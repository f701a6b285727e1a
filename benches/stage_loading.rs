//! What the stage benches share: loading one instance of a stage from a model folder, as the
//! server would, with a compiled-stage cache so that reruns do not recompile.

use std::path::Path;

use wasmtron::{
    proto::inference::ModelConfig,
    repository::config::parse_text,
    runtime::{self, RuntimeOptions},
};

/// The workspace root.
pub fn workspace() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

/// The first instance of the stage in `dir` (relative to the workspace), named `name`, with
/// `extra` appended to its config.pbtxt.
pub fn load(dir: &str, name: &str, extra: &str) -> Box<dyn runtime::ModelInstance> {
    let model_dir = workspace().join(dir);
    let text = std::fs::read_to_string(model_dir.join("config.pbtxt")).unwrap() + extra;
    let mut config: ModelConfig = parse_text(&text, Path::new("config.pbtxt")).unwrap();
    config.name = name.to_owned();
    let options = RuntimeOptions::default()
        .with_cache_dir(Some(std::env::temp_dir().join("wasmtron-bench-cache")));
    let mut loaded =
        runtime::load(config, &model_dir.join("1"), &options).expect("run `make stages` first");
    loaded.instances.remove(0)
}
