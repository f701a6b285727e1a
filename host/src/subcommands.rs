//! The binary's subcommands: `stage new|build|run` (a Wasm stage's project), `compile` and
//! `compile-python` (a repository's stages and the Python backend's interpreter, compiled
//! ahead of time), `convert` (PyTorch and
//! TensorFlow models to ONNX, into the conversion cache) and `hash-key` (a tenant key's hash
//! for the tenants file).

use std::{path::PathBuf, time::Duration};

use anyhow::bail;
use wasmtron::{
    repository::{validate::backend_name, ModelRepository},
    runtime::{conversion, model_config::model_file_name, python, sandbox, wasm},
};

use crate::{
    command_line::{Command, StageCommand},
    stage_cli,
};

/// Runs `command`.
pub async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Stage(stage) => run_stage(stage).await,
        Command::Compile {
            model_repositories,
            python_runtime,
            wasm_cache_dir,
        } => compile(model_repositories, python_runtime, wasm_cache_dir).await,
        Command::CompilePython {
            python_runtime,
            wasm_cache_dir,
        } => compile_python(python_runtime, wasm_cache_dir).await,
        Command::Convert {
            repository,
            converter_python,
            converter_timeout_secs,
            converter_sandbox,
            converter_memory_mb,
            wasm_cache_dir,
        } => {
            let options = conversion::ConversionSettings {
                cache_dir: wasm_cache_dir
                    .or_else(sandbox::engine::default_cache_dir)
                    .map(|dir| dir.join("converted")),
                converter: Some(conversion::ConverterSettings {
                    sandbox: converter_sandbox,
                    memory_mb: converter_memory_mb,
                    ..conversion::ConverterSettings::new(
                        converter_python,
                        Duration::from_secs(converter_timeout_secs.max(1)),
                    )
                }),
            };
            convert(repository, options).await
        }
        Command::HashKey { key } => hash_key(key),
    }
}

/// `stage new|build|run`: a failure is printed and exits with status 1.
async fn run_stage(command: StageCommand) -> anyhow::Result<()> {
    let result = match command {
        StageCommand::New(args) => stage_cli::new::new(args),
        StageCommand::Build(args) => {
            tokio::task::spawn_blocking(move || stage_cli::build::build(args)).await?
        }
        StageCommand::Run(args) => {
            tokio::task::spawn_blocking(move || stage_cli::run::run(args)).await?
        }
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
    Ok(())
}

/// The compile cache directory (`--wasm-cache-dir`, else the server's default), created.
fn compile_cache_dir(wasm_cache_dir: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let cache_dir = wasm_cache_dir
        .or_else(sandbox::engine::default_cache_dir)
        .ok_or_else(|| anyhow::anyhow!("no cache directory: set --wasm-cache-dir"))?;
    std::fs::create_dir_all(&cache_dir)?;
    Ok(cache_dir)
}

/// `compile`: every version of every Wasm stage in `repositories` compiled into the cache (or
/// found there), one line each, then the Python interpreter when a Python model is among
/// them. The engine is the server's default one, so a server started with other engine flags
/// (`--wasm-pooling-instances`) compiles again. An error when any stage could not be compiled.
async fn compile(
    repositories: Vec<PathBuf>,
    python_runtime: Option<PathBuf>,
    wasm_cache_dir: Option<PathBuf>,
) -> anyhow::Result<()> {
    let cache_dir = compile_cache_dir(wasm_cache_dir.clone())?;
    // Each repository on its own: a model name in two of them is compiled in both.
    let mut models = Vec::new();
    for root in repositories {
        models.extend(ModelRepository::new(vec![root]).discover()?);
    }
    let (failed, python_models) = tokio::task::spawn_blocking(move || {
        let cache = sandbox::compile_cache::CompileCache::open(
            &cache_dir,
            sandbox::compile_cache::DEFAULT_MAX_BYTES,
        );
        let mut failed = 0;
        let mut python_models = 0;
        for (name, source) in &models {
            let config = match source.read_config() {
                Ok(config) => config,
                Err(e) => {
                    println!("{name}: skipped: {e}");
                    continue;
                }
            };
            match backend_name(&config).as_deref() {
                Some(wasm::BACKEND) => {}
                Some(python::BACKEND) => {
                    python_models += 1;
                    continue;
                }
                _ => continue,
            }
            for version in source.available_versions() {
                let path = source
                    .dir
                    .join(version.to_string())
                    .join(model_file_name(&config, wasm::DEFAULT_MODEL_FILENAME));
                if !path.is_file() {
                    continue;
                }
                let started = std::time::Instant::now();
                let loaded = sandbox::engine::engine().and_then(|engine| {
                    sandbox::engine::load_component(engine, &path, cache.as_deref())
                });
                match loaded {
                    Ok((_, sandbox::engine::CompileSource::Cache)) => {
                        println!("{name} (version {version}): already in the cache")
                    }
                    Ok((_, sandbox::engine::CompileSource::Compiled)) => println!(
                        "{name} (version {version}): compiled in {:.1} s",
                        started.elapsed().as_secs_f64()
                    ),
                    Err(e) => {
                        failed += 1;
                        println!("{name} (version {version}): {}", e.message);
                    }
                }
            }
        }
        (failed, python_models)
    })
    .await?;
    if python_models > 0 {
        compile_python(python_runtime, wasm_cache_dir).await?;
    }
    if failed > 0 {
        bail!("{failed} stage version(s) could not be compiled");
    }
    Ok(())
}

/// `compile-python`: the interpreter module compiled into the cache, so that Python models
/// start in seconds.
async fn compile_python(
    python_runtime: Option<PathBuf>,
    wasm_cache_dir: Option<PathBuf>,
) -> anyhow::Result<()> {
    let dir = python_runtime.unwrap_or_else(python::interpreter::default_dir);
    let cache_dir = compile_cache_dir(wasm_cache_dir)?;
    let started = std::time::Instant::now();
    let compiled = tokio::task::spawn_blocking(move || {
        let cache = sandbox::compile_cache::CompileCache::open(
            &cache_dir,
            sandbox::compile_cache::DEFAULT_MAX_BYTES,
        );
        python::interpreter::runtime(&dir, cache.as_deref())
    })
    .await?;
    match compiled {
        Ok(rt) => println!(
            "Python interpreter ready ({}) in {:.1} s",
            rt.dir.display(),
            started.elapsed().as_secs_f64()
        ),
        Err(e) => bail!("{}", e.message),
    }
    Ok(())
}

/// `convert`: every PyTorch and TensorFlow model version of `repository` converted (or found
/// in the cache), one line each; an error when any could not be.
async fn convert(
    repository: PathBuf,
    options: conversion::ConversionSettings,
) -> anyhow::Result<()> {
    let done =
        tokio::task::spawn_blocking(move || conversion::convert_repository(&repository, &options))
            .await??;
    let mut failed = 0;
    for d in &done {
        match &d.outcome {
            Ok(c) => println!(
                "{} (version {}): {}{}",
                d.model,
                d.version,
                c.manifest.summary(),
                if c.cached {
                    " (already in the cache)".to_owned()
                } else {
                    format!(", in {:.1} s", c.manifest.seconds)
                }
            ),
            Err(e) => {
                failed += 1;
                println!("{} (version {}): {}", d.model, d.version, e.message);
            }
        }
    }
    if done.is_empty() {
        println!("no PyTorch or TensorFlow models to convert");
    }
    if failed > 0 {
        bail!("{failed} model version(s) could not be converted");
    }
    Ok(())
}

/// `hash-key`: the hash of a tenant's key (given, or read from the standard input), as the
/// tenants file holds it.
fn hash_key(key: Option<String>) -> anyhow::Result<()> {
    let key = match key {
        Some(k) => k,
        None => std::io::read_to_string(std::io::stdin())?,
    };
    let key = key.trim();
    if key.is_empty() {
        bail!("give a non-empty key");
    }
    println!("\"{}\"", wasmtron::tenancy::hash_key(key));
    Ok(())
}
