//! The metrics endpoint (`/metrics`): the server's metrics in the Prometheus text format
//! ([`crate::scheduling::views::metrics`]), rendered when scraped.
//!
//! With tenants, the metrics name every tenant and its models, which a tenant must not learn
//! of another: a scrape needs an administrator's key or must come from the loopback interface
//! (where the operator's Prometheus agent runs).

use std::{net::SocketAddr, sync::Arc};

use crate::{
    scheduling::{server::Server, views::metrics::text},
    tenancy::Tenancy,
};
use axum::{
    extract::{ConnectInfo, State},
    http::{header, HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::get,
    Extension, Router,
};

#[derive(Clone)]
struct MetricsState {
    server: Arc<Server>,
    tenancy: Option<Arc<Tenancy>>,
    /// Whether the host's CPU metrics are reported (`--allow-cpu-metrics`).
    cpu: bool,
    /// Whether the GPUs' metrics are reported (`--allow-gpu-metrics`, `cuda` builds).
    gpu: bool,
}

/// Router serving `/metrics`: the models' metrics, and with tenants each tenant's.
pub fn router(server: Arc<Server>, tenancy: Option<Arc<Tenancy>>, cpu: bool, gpu: bool) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .with_state(MetricsState {
            server,
            tenancy,
            cpu,
            gpu,
        })
}

async fn metrics(
    State(st): State<MetricsState>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    headers: HeaderMap,
) -> Response {
    if let Some(tenancy) = &st.tenancy {
        let peer = peer.map(|Extension(ConnectInfo(a))| a);
        let key = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if let Err(e) = may_scrape(tenancy, peer, key) {
            let status = super::http::status_for(e.code);
            let body = serde_json::json!({ "error": e.message }).to_string();
            return (status, [(header::CONTENT_TYPE, "application/json")], body).into_response();
        }
    }
    let text = if st.gpu && cfg!(feature = "cuda") {
        // NVML calls block: off the async runtime (only `cuda` builds have GPU metrics).
        let (server, tenancy) = (st.server.clone(), st.tenancy.clone());
        tokio::task::spawn_blocking(move || text(&server, tenancy.as_deref(), st.cpu, true))
            .await
            .unwrap_or_default()
    } else {
        text(&st.server, st.tenancy.as_deref(), st.cpu, false)
    };
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        text,
    )
        .into_response()
}

/// Whether a scrape from `peer` with `authorization` may read a server with tenants: from the
/// loopback interface, or with an administrator's key.
fn may_scrape(
    tenancy: &Tenancy,
    peer: Option<SocketAddr>,
    authorization: Option<&str>,
) -> crate::error::Result<()> {
    if peer.is_some_and(|a| a.ip().is_loopback()) {
        return Ok(());
    }
    tenancy
        .authenticate(authorization)?
        .require_admin("the metrics of a server with tenants (from another host)")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{error::Code, tenancy::hash_key};

    #[test]
    fn with_tenants_only_loopback_or_an_administrator_may_scrape() {
        let config = format!(
            "[[tenant]]\nname = \"alpha\"\napi_keys = [\"{}\"]\ninfer = [\"m\"]\n\n\
             [[tenant]]\nname = \"ops\"\napi_keys = [\"{}\"]\nadmin = true\n",
            hash_key("alpha-key"),
            hash_key("ops-key")
        );
        let tenancy = Tenancy::parse(&config, "w.toml").unwrap();
        let local: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let remote: SocketAddr = "192.0.2.7:5000".parse().unwrap();
        assert!(may_scrape(&tenancy, Some(local), None).is_ok());
        assert!(may_scrape(&tenancy, Some("[::1]:1".parse().unwrap()), None).is_ok());
        let e = may_scrape(&tenancy, Some(remote), None).unwrap_err();
        assert_eq!(e.code, Code::Unauthenticated);
        let e = may_scrape(&tenancy, Some(remote), Some("Bearer alpha-key")).unwrap_err();
        assert_eq!(e.code, Code::PermissionDenied);
        assert!(e.message.contains("metrics"), "{e:?}");
        assert!(may_scrape(&tenancy, Some(remote), Some("Bearer ops-key")).is_ok());
        assert!(may_scrape(&tenancy, None, None).is_err());
    }
}
