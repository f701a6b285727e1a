//! `wasmtron stage …`: the stage author's commands. `new` writes a ready-to-build stage in one
//! of four languages, `build` builds it with that language's toolchain, `run` executes it once
//! without a server.

pub mod build;
pub mod new;
pub mod run;

/// The languages a stage can be written in.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lang {
    /// Rust, with the wasmtron-guest crate (cargo, target wasm32-wasip2).
    Rust,
    /// Python, with the wasmtron_stage package (componentize-py).
    Python,
    /// JavaScript, with wasmtron-stage.js (componentize-js).
    Js,
    /// C, with bindings generated from the WIT (clang-19 + wasi-libc, componentize-c).
    C,
}

impl Lang {
    /// How the language is named in messages.
    pub fn name(self) -> &'static str {
        match self {
            Lang::Rust => "Rust",
            Lang::Python => "Python",
            Lang::Js => "JavaScript",
            Lang::C => "C",
        }
    }
}
