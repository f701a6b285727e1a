//! The HTTP frontends on one port: KServe v2 ([`kserve`]) and OpenAI's API ([`openai`]), two
//! siblings that never import each other, over shared plumbing: the listener's state
//! ([`HttpState`]), errors and their rendering per protocol, authentication, request bodies and
//! response compression.

pub mod kserve;
pub mod openai;

mod auth;
pub(crate) mod body;
pub(crate) mod compression;
pub(crate) mod error;
pub(crate) mod state;

use axum::{extract::DefaultBodyLimit, Router};

pub use error::{status_for, ApiError};
pub use kserve::{codec, generate};
pub use state::HttpState;

/// Builds the router with every route: KServe's and OpenAI's, each behind the authentication
/// layer that renders its refusals in its protocol's shape.
pub fn router(state: HttpState) -> Router {
    let guard = |render| {
        axum::middleware::from_fn_with_state(
            auth::Guard {
                http: state.clone(),
                render,
            },
            auth::authenticate,
        )
    };
    let kserve = kserve::routes().layer(guard(error::kserve_error as error::RenderError));
    let openai = openai::routes().layer(guard(openai::render_error as error::RenderError));
    kserve
        .merge(openai)
        // Bodies are read with our own limit so that oversize requests get a JSON error.
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
}
