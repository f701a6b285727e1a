//! TLS on a listener: on gRPC as Triton's `--grpc-use-ssl` flags set it up (the server's
//! certificate chain and key, PEM; with `--grpc-use-ssl-mutual` clients must present a
//! certificate that the given root certificates sign), and on the HTTP and metrics ports with
//! `--http-ssl-cert` / `--http-ssl-key`, which Triton lacks. rustls.

use std::{path::PathBuf, sync::Arc};

use tokio_rustls::{
    rustls::{
        crypto::aws_lc_rs,
        pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer},
        server::WebPkiClientVerifier,
        RootCertStore, ServerConfig,
    },
    TlsAcceptor,
};

/// The files of a TLS listener.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The server's certificate chain (`--grpc-server-cert`).
    pub cert: PathBuf,
    /// The server's private key (`--grpc-server-key`).
    pub key: PathBuf,
    /// Root certificates that sign the clients' certificates (`--grpc-root-cert`).
    pub root: Option<PathBuf>,
    /// Whether clients must present a certificate (`--grpc-use-ssl-mutual`).
    pub mutual: bool,
    /// The flags that named the certificate, the key and the root (for messages).
    pub flags: [&'static str; 3],
}

/// The acceptor for `files`, offering `alpn` protocols; the error names the file at fault.
pub fn acceptor(files: &TlsFiles, alpn: &[&[u8]]) -> Result<TlsAcceptor, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
        .and_then(|certs| certs.collect())
        .map_err(|e| format!("{} {}: {e}", files.flags[0], files.cert.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{} {}: no certificate in it (PEM)",
            files.flags[0],
            files.cert.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| format!("{} {}: {e}", files.flags[1], files.key.display()))?;
    let provider = Arc::new(aws_lc_rs::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = if files.mutual {
        let Some(root) = &files.root else {
            return Err(
                "--grpc-use-ssl-mutual needs --grpc-root-cert (the certificates that sign the \
                 clients')"
                    .to_owned(),
            );
        };
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(root)
            .map_err(|e| format!("{} {}: {e}", files.flags[2], root.display()))?
        {
            let cert = cert.map_err(|e| format!("{} {}: {e}", files.flags[2], root.display()))?;
            roots
                .add(cert)
                .map_err(|e| format!("{} {}: {e}", files.flags[2], root.display()))?;
        }
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .map_err(|e| format!("{} {}: {e}", files.flags[2], root.display()))?;
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| format!("{} / {}: {e}", files.flags[0], files.flags[1]))?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(TlsAcceptor::from(Arc::new(config)))
}
