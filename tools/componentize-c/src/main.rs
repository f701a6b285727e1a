//! Builds Wasmtron stages written in C without `cargo install`ing wit-bindgen and wasm-tools:
//! the same libraries, driven by the two steps a C stage needs.
//!
//! ```text
//! componentize-c bindings --wit wit --world stage --out-dir gen   # gen/stage.{h,c}, gen/stage_component_type.o
//! clang-19 --target=wasm32-wasi -mexec-model=reactor -O2 -o core.wasm app.c gen/stage.c gen/stage_component_type.o
//! componentize-c component core.wasm -o model.wasm                 # core module + WASI preview1 adapter
//! ```

use std::fs;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use wasi_preview1_component_adapter_provider::{
    WASI_SNAPSHOT_PREVIEW1_ADAPTER_NAME, WASI_SNAPSHOT_PREVIEW1_REACTOR_ADAPTER,
};
use wit_bindgen_core::Files;
use wit_component::ComponentEncoder;
use wit_parser::Resolve;

#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate the C bindings (`<world>.h`, `<world>.c`, `<world>_component_type.o`).
    Bindings {
        /// The WIT package directory.
        #[arg(long, default_value = "wit")]
        wit: PathBuf,
        /// The world the stage implements.
        #[arg(long, default_value = "stage")]
        world: String,
        #[arg(long)]
        out_dir: PathBuf,
    },
    /// Turn a core module built with wasi-libc (reactor) into a component.
    Component {
        /// The core module clang produced.
        core: PathBuf,
        #[arg(short, long)]
        output: PathBuf,
    },
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Bindings {
            wit,
            world,
            out_dir,
        } => bindings(&wit, &world, &out_dir),
        Command::Component { core, output } => component(&core, &output),
    }
}

fn bindings(wit: &std::path::Path, world: &str, out_dir: &std::path::Path) -> Result<()> {
    let mut resolve = Resolve::default();
    let (package, _) = resolve
        .push_path(wit)
        .with_context(|| format!("reading WIT from {}", wit.display()))?;
    let world = resolve.select_world(&[package], Some(world))?;
    let mut files = Files::default();
    wit_bindgen_c::Opts::default()
        .build()
        .generate(&mut resolve, world, &mut files)?;
    fs::create_dir_all(out_dir)?;
    for (name, contents) in files.iter() {
        let path = out_dir.join(name);
        fs::write(&path, contents).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn component(core: &std::path::Path, output: &std::path::Path) -> Result<()> {
    let module = fs::read(core).with_context(|| format!("reading {}", core.display()))?;
    let bytes = ComponentEncoder::default()
        .validate(true)
        .module(&module)
        .context("the core module carries no component type: link <world>_component_type.o")?
        .adapter(
            WASI_SNAPSHOT_PREVIEW1_ADAPTER_NAME,
            WASI_SNAPSHOT_PREVIEW1_REACTOR_ADAPTER,
        )?
        .encode()?;
    fs::write(output, bytes).with_context(|| format!("writing {}", output.display()))?;
    Ok(())
}
