//! Wasmtron guest SDK: helpers for writing WebAssembly stages (filled in with the Wasm stage work).
