//! Optional TLS (rustls with ring) on the cluster gRPC: a worker serves with its
//! certificate and key, the driver trusts the cluster's CA. Files are read and checked
//! when loaded, so a bad path or PEM is named before anything listens or connects.

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig};

/// A TLS file that cannot be used, always naming the file (and the flag or key, when
/// the caller gave one).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what} {path}: {message}")]
    File {
        what: String,
        path: PathBuf,
        message: String,
    },
    #[error("--tls-cert {cert} / --tls-key {key}: not a usable certificate and key: {message}")]
    Pair {
        cert: PathBuf,
        key: PathBuf,
        message: String,
    },
}

impl TlsError {
    fn file(what: &str, path: &Path, message: impl Into<String>) -> Self {
        TlsError::File {
            what: what.to_string(),
            path: path.to_path_buf(),
            message: message.into(),
        }
    }
}

/// `error` and its sources, joined: tonic's transport errors say little at the top.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        let s = e.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        source = e.source();
    }
    text
}

/// A status's message and the transport errors under it (where a failed TLS handshake
/// or a plaintext/TLS mismatch shows).
pub fn status_chain(status: &tonic::Status) -> String {
    let mut text = status.message().to_string();
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        let s = e.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        source = e.source();
    }
    text
}

/// Reads a PEM file that must hold a block whose label contains `label`.
fn read_pem(what: &str, path: &Path, label: &str) -> Result<Vec<u8>, TlsError> {
    let bytes = std::fs::read(path).map_err(|e| TlsError::file(what, path, e.to_string()))?;
    let text = String::from_utf8_lossy(&bytes);
    let found = text
        .lines()
        .any(|l| l.starts_with("-----BEGIN ") && l.contains(label));
    if !found {
        return Err(TlsError::file(
            what,
            path,
            format!("no PEM `-----BEGIN ...{label}-----` block in the file"),
        ));
    }
    Ok(bytes)
}

/// The worker side: its certificate chain and private key.
#[derive(Clone)]
pub struct ServerTls {
    identity: Identity,
}

impl ServerTls {
    /// Loads `cert` (PEM chain, leaf first) and `key` (PEM private key) and checks that
    /// rustls accepts the pair.
    pub fn from_files(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let cert_pem = read_pem("--tls-cert", cert, "CERTIFICATE")?;
        let key_pem = read_pem("--tls-key", key, "PRIVATE KEY")?;
        let tls = Self {
            identity: Identity::from_pem(cert_pem, key_pem),
        };
        Server::builder()
            .tls_config(tls.config())
            .map_err(|e| TlsError::Pair {
                cert: cert.to_path_buf(),
                key: key.to_path_buf(),
                message: error_chain(&e),
            })?;
        Ok(tls)
    }

    /// From PEM bytes already in memory (tests, embedding).
    pub fn from_pem(cert_pem: impl AsRef<[u8]>, key_pem: impl AsRef<[u8]>) -> Self {
        Self {
            identity: Identity::from_pem(cert_pem, key_pem),
        }
    }

    pub(crate) fn config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(self.identity.clone())
    }
}

/// The client side: the CA that signed the workers' certificates, and optionally the
/// name to expect in them (default: the host of each node's address).
#[derive(Clone)]
pub struct ClientTls {
    ca: Certificate,
    domain: Option<String>,
}

impl ClientTls {
    /// Loads the CA certificate(s) from `ca` (PEM); `what` names where the path came
    /// from in errors (e.g. "cluster.tls_ca").
    pub fn from_file(what: &str, ca: &Path, domain: Option<String>) -> Result<Self, TlsError> {
        let pem = read_pem(what, ca, "CERTIFICATE")?;
        let tls = Self::from_pem(pem, domain);
        Endpoint::from_static("https://localhost")
            .tls_config(tls.config())
            .map_err(|e| {
                TlsError::file(
                    what,
                    ca,
                    format!("not a usable CA certificate: {}", error_chain(&e)),
                )
            })?;
        Ok(tls)
    }

    /// From PEM bytes already in memory (tests, embedding).
    pub fn from_pem(ca_pem: impl AsRef<[u8]>, domain: Option<String>) -> Self {
        Self {
            ca: Certificate::from_pem(ca_pem),
            domain,
        }
    }

    pub(crate) fn config(&self) -> ClientTlsConfig {
        let config = ClientTlsConfig::new().ca_certificate(self.ca.clone());
        match &self.domain {
            Some(d) => config.domain_name(d.clone()),
            None => config,
        }
    }
}
