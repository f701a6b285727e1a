//! The one wasmtime engine of the process: configured once (epoch interruption for
//! deadlines), ticked by a background thread, and backed by an on-disk cache of compiled
//! components so that a restart does not recompile (Python/JS stages take seconds to compile).

use std::{
    path::{Path, PathBuf},
    sync::OnceLock,
    time::Duration,
};

use wasmtime::{
    component::Component, Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig,
};

use super::compile_cache::CompileCache;
use crate::error::{Error, Result};

/// How often the epoch advances; deadlines are whole numbers of ticks.
pub const EPOCH_TICK: Duration = Duration::from_millis(10);

/// Process-wide engine settings, fixed before the first stage loads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineOptions {
    /// Instances the pooling allocator preallocates slots for; 0 allocates on demand.
    pub pooling_instances: u32,
}

/// The linear-memory slot of the pooling allocator: stages whose `memory_limit_mb` is larger
/// cannot load while pooling is on.
pub const POOLING_MEMORY_MB: u64 = 512;

static OPTIONS: OnceLock<EngineOptions> = OnceLock::new();

/// Sets the engine options; call once before any stage loads.
pub fn configure(options: EngineOptions) -> Result<()> {
    if OPTIONS.get_or_init(|| options) == &options {
        Ok(())
    } else {
        Err(Error::internal(
            "the wasm engine was already configured differently",
        ))
    }
}

/// The options the engine runs with.
pub fn options() -> EngineOptions {
    OPTIONS.get().copied().unwrap_or_default()
}

/// Slots for `n` stage instances. Python and JavaScript components hold several core
/// instances, memories and tables each, hence the multiples.
fn pooling(n: u32) -> PoolingAllocationConfig {
    let mut p = PoolingAllocationConfig::new();
    p.total_component_instances(n)
        .total_core_instances(n.saturating_mul(4))
        .total_memories(n.saturating_mul(2))
        .total_tables(n.saturating_mul(4))
        .total_stacks(n)
        .max_core_instances_per_component(64)
        .max_memories_per_component(4)
        .max_tables_per_component(16)
        .max_tables_per_module(4)
        .max_memories_per_module(2)
        .max_core_instance_size(1 << 20)
        .max_component_instance_size(1 << 20)
        .max_memory_size((POOLING_MEMORY_MB as usize) << 20);
    p
}

/// The shared engine, created on first use with its ticker thread.
pub fn engine() -> Result<&'static Engine> {
    static ENGINE: OnceLock<std::result::Result<Engine, String>> = OnceLock::new();
    ENGINE
        .get_or_init(|| {
            let mut config = Config::new();
            // Deadlines without fuel's per-instruction cost: a ticker bumps the epoch and each
            // store traps once it is past its deadline.
            config.epoch_interruption(true);
            config.parallel_compilation(true);
            // `WASMTRON_PERF_MAP=1` names the stages' compiled functions for Linux `perf`
            // (/tmp/perf-PID.map), so that a stage's hot spots show up in a profile.
            if std::env::var_os("WASMTRON_PERF_MAP").is_some_and(|v| v == "1") {
                config.profiler(wasmtime::ProfilingStrategy::PerfMap);
            }
            let options = options();
            if options.pooling_instances > 0 {
                // Preallocated slots make instantiation cheaper (fresh instances per request).
                config.allocation_strategy(InstanceAllocationStrategy::Pooling(pooling(
                    options.pooling_instances,
                )));
            }
            let engine = Engine::new(&config).map_err(|e| format!("cannot start wasmtime: {e}"))?;
            spawn_epoch_ticker(&engine, "wasm-epoch")?;
            Ok(engine)
        })
        .as_ref()
        .map_err(|e| Error::internal(e.clone()))
}

/// Starts the thread that advances `engine`'s epoch every [`EPOCH_TICK`], for its lifetime.
pub fn spawn_epoch_ticker(engine: &Engine, name: &str) -> std::result::Result<(), String> {
    let ticker = engine.clone();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || loop {
            std::thread::sleep(EPOCH_TICK);
            ticker.increment_epoch();
        })
        .map(|_| ())
        .map_err(|e| format!("cannot start the epoch ticker: {e}"))
}

/// Where compiled components are kept: `WASMTRON_CACHE_DIR`, else `$XDG_CACHE_HOME/wasmtron`,
/// else `$HOME/.cache/wasmtron`. The cache holds native code that is loaded without
/// re-validation, so it must live somewhere only this user can write.
pub fn default_cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("WASMTRON_CACHE_DIR") {
        return Some(PathBuf::from(dir));
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(dir).join("wasmtron"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("wasmtron"))
}

/// Whether a component came from the cache or was compiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompileSource {
    /// Loaded from a previously compiled artifact.
    Cache,
    /// Compiled now (and stored, when a cache directory is set).
    Compiled,
}

/// Loads a component: from the cache when a matching compiled artifact exists, otherwise by
/// compiling and storing the result.
pub fn load_component(
    engine: &Engine,
    wasm_path: &Path,
    cache: Option<&CompileCache>,
) -> Result<(Component, CompileSource)> {
    let wasm = std::fs::read(wasm_path)
        .map_err(|e| Error::invalid(format!("cannot read '{}': {e}", wasm_path.display())))?;
    let cached = cache.map(|cache| (cache, cache.entry(engine, &wasm)));
    if let Some((cache, entry)) = &cached {
        if let Some(component) = cache.load(engine, entry) {
            return Ok((component, CompileSource::Cache));
        }
    }
    let component = Component::new(engine, &wasm).map_err(|e| {
        Error::invalid(format!(
            "'{}' is not a valid WebAssembly component: {e:#}",
            wasm_path.display()
        ))
    })?;
    if let Some((cache, entry)) = cached {
        if let Err(e) = cache.store(&component, &entry) {
            tracing::warn!(path = %cache.shown(&entry).display(), error = %e, "cannot cache the compiled component");
        }
    }
    Ok((component, CompileSource::Compiled))
}
