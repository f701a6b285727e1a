//! Who sent an HTTP request: the restricted API groups' headers are checked, the API key is
//! resolved to a [`Caller`] and handed to the handlers. Health probes need no key, so that
//! orchestrators can check the server. Each family of routes (KServe, OpenAI) is guarded by
//! its own layer, which renders refusals in that family's error shape.

use axum::{extract::State, http::header, response::Response};

use super::{error::RenderError, state::HttpState};
use crate::{frontends::restricted::ApiGroup, tenancy::Caller};

/// The state of one authentication layer: the listener's and how its routes render errors.
#[derive(Clone)]
pub(crate) struct Guard {
    pub(crate) http: HttpState,
    pub(crate) render: RenderError,
}

/// The middleware: refuses what the restrictions or the tenants refuse, else runs the route
/// with the [`Caller`] in the request's extensions.
pub(crate) async fn authenticate(
    State(guard): State<Guard>,
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let st = &guard.http;
    if let Some(group) = ApiGroup::of_http_path(request.uri().path()) {
        let headers = request.headers();
        if let Err(e) = st.restrictions.check(group, |name| {
            headers.get(name).and_then(|v| v.to_str().ok())
        }) {
            return (guard.render)(&e);
        }
    }
    let caller = match &st.tenancy {
        Some(tenancy) if !request.uri().path().starts_with("/v2/health/") => {
            let key = request
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok());
            match tenancy.authenticate(key) {
                Ok(caller) => caller,
                Err(e) => return (guard.render)(&e),
            }
        }
        _ => Caller::Anyone,
    };
    request.extensions_mut().insert(caller);
    next.run(request).await
}
