//! `wasmtron stage build [DIR]`: builds a stage with its language's toolchain into
//! `DIR/1/model.wasm`. The SDK and the WIT come from this binary (written to `DIR/.wasmtron/`
//! on every build), so a stage always builds against the interface the server offers.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{anyhow, bail, Context};

use super::Lang;

/// Arguments of `wasmtron stage build`.
#[derive(clap::Args, Debug)]
pub struct BuildArgs {
    /// The stage's folder (as `wasmtron stage new` wrote it).
    #[arg(default_value = ".")]
    dir: PathBuf,
    /// Where to write the component (default: DIR/1/model.wasm).
    #[arg(long)]
    out: Option<PathBuf>,
}

const WIT: &str = include_str!("../../../wit/stage.wit");
const PYTHON_SDK: [(&str, &str); 5] = [
    (
        "__init__.py",
        include_str!("../../../guest-sdk/python/wasmtron_stage/__init__.py"),
    ),
    (
        "component.py",
        include_str!("../../../guest-sdk/python/wasmtron_stage/component.py"),
    ),
    (
        "errors.py",
        include_str!("../../../guest-sdk/python/wasmtron_stage/errors.py"),
    ),
    (
        "ops.py",
        include_str!("../../../guest-sdk/python/wasmtron_stage/ops.py"),
    ),
    (
        "tensor.py",
        include_str!("../../../guest-sdk/python/wasmtron_stage/tensor.py"),
    ),
];
const JS_SDK: &str = include_str!("../../../guest-sdk/js/wasmtron-stage.js");
const RUST_SDK: &str = include_str!("../../../guest-sdk/src/lib.rs");
const RUST_SDK_MANIFEST: &str = include_str!("../../templates/stage/guest-sdk.toml");

/// Pinned tool versions, for the install hints.
const COMPONENTIZE_PY: &str = "componentize-py==0.25.1";
const COMPONENTIZE_JS: &str = "@bytecodealliance/componentize-js@0.23.0";

/// Where the SDK and WIT go inside a stage's folder.
const SDK_DIR: &str = ".wasmtron";

/// Writes the WIT and `lang`'s SDK into `DIR/.wasmtron/`.
pub fn write_sdk(dir: &Path, lang: Lang) -> anyhow::Result<()> {
    let sdk = dir.join(SDK_DIR);
    let put = |path: &str, text: &str| -> anyhow::Result<()> {
        let target = sdk.join(path);
        std::fs::create_dir_all(target.parent().unwrap_or(&sdk))?;
        std::fs::write(&target, text).with_context(|| format!("cannot write {}", target.display()))
    };
    put("wit/stage.wit", WIT)?;
    match lang {
        Lang::Python => {
            for (file, text) in PYTHON_SDK {
                put(&format!("python/wasmtron_stage/{file}"), text)?;
            }
        }
        Lang::Js => put("js/wasmtron-stage.js", JS_SDK)?,
        Lang::Rust => {
            put("guest-sdk/Cargo.toml", RUST_SDK_MANIFEST)?;
            put("guest-sdk/src/lib.rs", RUST_SDK)?;
        }
        Lang::C => {}
    }
    Ok(())
}

/// The stage's language, from the files `stage new` writes.
fn detect(dir: &Path) -> anyhow::Result<Lang> {
    let found = [
        ("Cargo.toml", Lang::Rust),
        ("src/app.py", Lang::Python),
        ("src/app.js", Lang::Js),
        ("src/stage.c", Lang::C),
    ]
    .into_iter()
    .find(|(file, _)| dir.join(file).is_file());
    found.map(|(_, lang)| lang).ok_or_else(|| {
        anyhow!(
            "{} holds no stage: expected Cargo.toml (Rust), src/app.py (Python), src/app.js \
             (JavaScript) or src/stage.c (C); `wasmtron stage new NAME --lang …` writes one",
            dir.display()
        )
    })
}

/// A program on PATH, else in the given folders.
fn find_tool(name: &str, also: &[PathBuf]) -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path
        .iter()
        .chain(also)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

fn run(mut command: Command, what: &str) -> anyhow::Result<()> {
    let status = command
        .status()
        .with_context(|| format!("cannot start {what}"))?;
    if !status.success() {
        bail!("{what} failed ({status}); its messages are above");
    }
    Ok(())
}

/// Builds the stage and reports where the component went.
pub fn build(args: BuildArgs) -> anyhow::Result<()> {
    let dir = args
        .dir
        .canonicalize()
        .with_context(|| format!("no folder {}", args.dir.display()))?;
    let lang = detect(&dir)?;
    write_sdk(&dir, lang)?;
    let out = match args.out {
        Some(out) => std::path::absolute(out)?,
        None => dir.join("1").join("model.wasm"),
    };
    if let Some(parent) = out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let sdk = dir.join(SDK_DIR);
    let tool = match lang {
        Lang::Python => build_python(&dir, &sdk, &out)?,
        Lang::Js => build_js(&dir, &sdk, &out)?,
        Lang::Rust => build_rust(&dir, &out)?,
        Lang::C => build_c(&dir, &sdk, &out)?,
    };
    let size = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
    println!(
        "built {} ({:.1} MB, {} with {tool})",
        out.display(),
        size as f64 / 1e6,
        lang.name()
    );
    Ok(())
}

fn build_python(dir: &Path, sdk: &Path, out: &Path) -> anyhow::Result<&'static str> {
    let venv: Vec<PathBuf> = std::env::var_os("VIRTUAL_ENV")
        .map(|v| vec![PathBuf::from(v).join("bin")])
        .unwrap_or_default();
    let tool = find_tool("componentize-py", &venv).ok_or_else(|| {
        anyhow!(
            "componentize-py not found on PATH: install it with `pip install {COMPONENTIZE_PY}`"
        )
    })?;
    let mut command = Command::new(tool);
    command
        .arg("-d")
        .arg(sdk.join("wit"))
        .args([
            "-w",
            "stage",
            "componentize",
            "wasmtron_stage.component",
            "-p",
        ])
        .arg(dir.join("src"))
        .arg("-p")
        .arg(sdk.join("python"))
        .arg("-o")
        .arg(out);
    run(command, "componentize-py")?;
    Ok("componentize-py")
}

fn build_js(dir: &Path, sdk: &Path, out: &Path) -> anyhow::Result<&'static str> {
    let local: Vec<PathBuf> = dir
        .ancestors()
        .map(|d| d.join("node_modules").join(".bin"))
        .collect();
    let tool = find_tool("componentize-js", &local).ok_or_else(|| {
        anyhow!(
            "componentize-js not found on PATH or in node_modules/.bin: run `npm install` in {} \
             (its package.json lists it) or `npm install -g {COMPONENTIZE_JS}`",
            dir.display()
        )
    })?;
    let mut command = Command::new(tool);
    command
        .arg(dir.join("src").join("app.js"))
        .arg("--wit")
        .arg(sdk.join("wit"))
        .args(["--world-name", "stage", "-d", "http", "fetch-event", "-o"])
        .arg(out);
    run(command, "componentize-js")?;
    Ok("componentize-js")
}

fn build_rust(dir: &Path, out: &Path) -> anyhow::Result<&'static str> {
    let manifest = dir.join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest)?;
    let table: toml::Table =
        toml::from_str(&text).with_context(|| format!("cannot parse {}", manifest.display()))?;
    let package = table
        .get("package")
        .and_then(|p| p.get("name"))
        .and_then(|n| n.as_str())
        .ok_or_else(|| anyhow!("{} has no [package] name", manifest.display()))?;
    let mut command = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    command
        .args([
            "build",
            "--release",
            "--target",
            "wasm32-wasip2",
            "--manifest-path",
        ])
        .arg(&manifest);
    run(
        command,
        "cargo build (is the target installed? `rustup target add wasm32-wasip2`)",
    )?;
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| dir.join("target"));
    let built = target_dir
        .join("wasm32-wasip2/release")
        .join(format!("{}.wasm", package.replace('-', "_")));
    std::fs::copy(&built, out).with_context(|| format!("cannot copy {}", built.display()))?;
    Ok("cargo")
}

fn build_c(dir: &Path, sdk: &Path, out: &Path) -> anyhow::Result<&'static str> {
    let beside: Vec<PathBuf> = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
        .into_iter()
        .collect();
    let componentize = find_tool("componentize-c", &beside).ok_or_else(|| {
        anyhow!(
            "componentize-c not found on PATH or beside wasmtron: build it from the wasmtron \
             source with `cargo install --path tools/componentize-c`"
        )
    })?;
    let clang = ["clang-19", "clang"]
        .into_iter()
        .find_map(|c| find_tool(c, &[]))
        .ok_or_else(|| {
            anyhow!("clang-19 not found: install `clang-19 lld-19 wasi-libc libclang-rt-19-dev-wasm32` (Debian/Ubuntu)")
        })?;
    let gen = sdk.join("c");
    let _ = std::fs::remove_dir_all(&gen);
    let mut bindings = Command::new(&componentize);
    bindings
        .arg("bindings")
        .arg("--wit")
        .arg(sdk.join("wit"))
        .args(["--world", "stage", "--out-dir"])
        .arg(&gen);
    run(bindings, "componentize-c bindings")?;
    let mut sources: Vec<PathBuf> = std::fs::read_dir(dir.join("src"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "c"))
        .collect();
    sources.sort();
    let core = sdk.join("stage.core.wasm");
    let mut compile = Command::new(clang);
    compile
        .args([
            "--target=wasm32-wasi",
            "-mexec-model=reactor",
            "-O2",
            "-Wall",
        ])
        .arg(format!("-I{}", gen.display()))
        .arg("-o")
        .arg(&core)
        .args(&sources)
        .arg(gen.join("stage.c"))
        .arg(gen.join("stage_component_type.o"));
    run(compile, "clang")?;
    let mut component = Command::new(componentize);
    component.arg("component").arg(&core).arg("-o").arg(out);
    run(component, "componentize-c component")?;
    Ok("clang + componentize-c")
}
