//! `wasmtron stage new NAME --lang …`: writes a stage that builds and runs as it is — its
//! source, config.pbtxt, a test input and the SDK — so that a stage author starts from
//! something that works.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

use super::{build::write_sdk, Lang};

/// Arguments of `wasmtron stage new`.
#[derive(clap::Args, Debug)]
pub struct NewArgs {
    /// The stage's (model's) name; also the folder it is written to.
    name: String,
    /// The language to write it in.
    #[arg(long, value_enum)]
    lang: Lang,
    /// Where to write it (default: ./NAME).
    #[arg(long)]
    dir: Option<PathBuf>,
}

const CONFIG: &str = include_str!("../../templates/stage/config.pbtxt");
const INPUT: &str = include_str!("../../templates/stage/input.json");
const APP_PY: &str = include_str!("../../templates/stage/app.py");
const APP_JS: &str = include_str!("../../templates/stage/app.js");
const PACKAGE_JSON: &str = include_str!("../../templates/stage/package.json");
const CARGO_TOML: &str = include_str!("../../templates/stage/Cargo.toml");
const LIB_RS: &str = include_str!("../../templates/stage/lib.rs");
const STAGE_C: &str = include_str!("../../templates/stage/stage.c");

/// The source files of a new stage in `lang`: (path inside the stage, template).
fn sources(lang: Lang) -> Vec<(&'static str, &'static str)> {
    match lang {
        Lang::Python => vec![("src/app.py", APP_PY)],
        Lang::Js => vec![("src/app.js", APP_JS), ("package.json", PACKAGE_JSON)],
        Lang::Rust => vec![("Cargo.toml", CARGO_TOML), ("src/lib.rs", LIB_RS)],
        Lang::C => vec![("src/stage.c", STAGE_C)],
    }
}

/// Model names as repositories accept them, which also suit a crate or package name.
fn check_name(name: &str) -> anyhow::Result<()> {
    let mut chars = name.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic());
    if !first_ok || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
        bail!(
            "stage name '{name}': use a letter first, then letters, digits, '_' or '-' \
             (it names the model, its folder and its package)"
        );
    }
    Ok(())
}

fn write(dir: &Path, path: &str, text: &str) -> anyhow::Result<()> {
    let target = dir.join(path);
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&target, text).with_context(|| format!("cannot write {}", target.display()))
}

/// Writes the stage and prints what to do next.
pub fn new(args: NewArgs) -> anyhow::Result<()> {
    check_name(&args.name)?;
    let dir = args.dir.unwrap_or_else(|| PathBuf::from(&args.name));
    if dir.exists() && std::fs::read_dir(&dir)?.next().is_some() {
        bail!(
            "{} exists and is not empty; pick another name or --dir",
            dir.display()
        );
    }
    let fill = |t: &str| {
        t.replace("{name}", &args.name)
            .replace("{lang}", args.lang.name())
    };
    write(&dir, "config.pbtxt", &fill(CONFIG))?;
    write(&dir, "input.json", INPUT)?;
    for (path, template) in sources(args.lang) {
        write(&dir, path, &fill(template))?;
    }
    write(
        &dir,
        ".gitignore",
        "# Written by wasmtron stage build\n.wasmtron/\n/1/model.wasm\ntarget/\nnode_modules/\n",
    )?;
    std::fs::create_dir_all(dir.join("1"))?;
    write_sdk(&dir, args.lang)?;
    let d = dir.display();
    println!("wrote a {} stage in {d}/", args.lang.name());
    println!("  build:  wasmtron stage build {d}");
    println!("  try:    wasmtron stage run {d}/1/model.wasm --input INPUT0={d}/input.json");
    println!(
        "  serve:  mkdir -p REPOSITORY/{0} && cp -r {d}/config.pbtxt {d}/1 REPOSITORY/{0}/",
        args.name
    );
    if args.lang == Lang::Js {
        println!("  (first: `npm install` in {d}, for componentize-js)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_must_suit_models_and_packages() {
        assert!(check_name("demo_stage-2").is_ok());
        for bad in ["", "2demo", "demo stage", "../x", "démo"] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }
}
