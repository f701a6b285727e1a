//! The host of all guest code, shared by the Wasm-stage and the Python backends (neither
//! imports the other): wasmtime's engine and its epoch ticker, the cache of compiled guest
//! code, and the limits a guest runs under (memory, deadline through epochs, tables).

pub mod compile_cache;
pub mod engine;
pub mod limits;
