//! TLS for kvxfer's TCP channels: the bootstrap service's connections and the tcp backend's
//! streams, with rustls (ring provider).
//!
//! **The model: one cluster CA.** Every rank and the bootstrap service hold a certificate and key
//! signed by the cluster's CA, and trust exactly that CA. Both ends of every connection present
//! their certificate (mutual TLS), so TLS alone already keeps out whoever holds no certificate of
//! the cluster; the cluster secret (`KVXFER_SECRET`) still authenticates ranks on top of it, as
//! without TLS. Clients check the server's certificate against [`Tls::server_name`] (default
//! [`DEFAULT_SERVER_NAME`], `kvxfer`, which the generated certificates carry), not against the
//! address they dialled, so one cluster certificate serves every host.
//!
//! **Where the material comes from.** PEM files ([`TlsFiles`], [`Tls::from_files`], or the
//! environment: [`Tls::from_env`] reads `KVXFER_TLS_CERT`, `KVXFER_TLS_KEY`, `KVXFER_TLS_CA`), or a
//! pair generated on the spot for a demo or a test ([`Tls::generate`]: a fresh CA and a
//! certificate it signed, valid for `kvxfer`, `localhost` and `127.0.0.1`; write it out with
//! [`Generated::write_to`] to hand it to other processes).
//!
//! What TLS costs is measured by `kvxfer bench` (tcp backend, `tls=on` next to plaintext); see
//! docs/operations.md (Security).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

pub use tokio_rustls::client::TlsStream as ClientStream;
pub use tokio_rustls::server::TlsStream as ServerStream;
/// Either end's TLS stream ([`Tls::connect_over`] or [`Tls::accept_over`], converted with `into`).
pub use tokio_rustls::TlsStream as Stream;

/// The name clients check servers' certificates against unless told otherwise.
pub const DEFAULT_SERVER_NAME: &str = "kvxfer";

/// Environment variable of the certificate file ([`Tls::from_env`]).
pub const CERT_ENV: &str = "KVXFER_TLS_CERT";
/// Environment variable of the private key file ([`Tls::from_env`]).
pub const KEY_ENV: &str = "KVXFER_TLS_KEY";
/// Environment variable of the CA file ([`Tls::from_env`]).
pub const CA_ENV: &str = "KVXFER_TLS_CA";

/// A TLS setup that cannot be used, or a handshake that failed, saying what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsError {
    /// A file cannot be read.
    #[error("TLS: cannot read the {what} file {path}: {detail}")]
    Read {
        /// Certificate, key or CA.
        what: &'static str,
        /// The file.
        path: String,
        /// The cause.
        detail: String,
    },
    /// A file holds no usable PEM item of the kind needed.
    #[error("TLS: {path} holds no {what} in PEM form (`-----BEGIN ...-----`): {detail}")]
    Pem {
        /// What was expected.
        what: &'static str,
        /// The file (or `memory`).
        path: String,
        /// The cause.
        detail: String,
    },
    /// Some of the cert, key and CA variables are set, others not.
    #[error("TLS: {set} set but {missing} not; set all of {CERT_ENV}, {KEY_ENV} and {CA_ENV}, or none")]
    Incomplete {
        /// The variables that are set.
        set: String,
        /// The ones that are missing.
        missing: String,
    },
    /// rustls refused the configuration (for example a key that does not match the certificate).
    #[error("TLS: invalid configuration: {detail}")]
    Config {
        /// The cause.
        detail: String,
    },
    /// Generating a certificate failed.
    #[error("TLS: cannot generate a certificate: {detail}")]
    Generate {
        /// The cause.
        detail: String,
    },
    /// The handshake with a peer failed or did not finish in time.
    #[error(
        "TLS handshake with {peer} failed: {detail}; do both sides use TLS with certificates of the same cluster CA?"
    )]
    Handshake {
        /// The peer's address.
        peer: String,
        /// The cause.
        detail: String,
    },
}

/// The PEM files of one rank (or service).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// This end's certificate (chain), PEM.
    pub cert: PathBuf,
    /// Its private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The cluster CA's certificate(s), PEM: the only roots trusted for peers.
    pub ca: PathBuf,
}

/// A rank's TLS setup: the server and client configurations, both with this end's certificate and
/// the cluster CA as their only root. Cheap to clone.
#[derive(Clone)]
pub struct Tls {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
    server_name: ServerName<'static>,
    name: String,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls").field("server_name", &self.name).finish_non_exhaustive()
    }
}

/// A generated cluster CA and a certificate it signed ([`Tls::generate`]), in PEM. The key is
/// secret material: [`Generated::write_to`] writes it with mode 0600.
#[derive(Clone)]
pub struct Generated {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// Its private key, PEM.
    pub key_pem: String,
    /// The CA certificate, PEM.
    pub ca_pem: String,
}

impl fmt::Debug for Generated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Generated(..)")
    }
}

impl Generated {
    /// Writes `cert.pem`, `key.pem` (mode 0600) and `ca.pem` into `dir` (created if needed) and
    /// returns their paths.
    pub fn write_to(&self, dir: &Path) -> std::io::Result<TlsFiles> {
        std::fs::create_dir_all(dir)?;
        let files = TlsFiles { cert: dir.join("cert.pem"), key: dir.join("key.pem"), ca: dir.join("ca.pem") };
        std::fs::write(&files.cert, &self.cert_pem)?;
        write_private(&files.key, self.key_pem.as_bytes())?;
        std::fs::write(&files.ca, &self.ca_pem)?;
        Ok(files)
    }
}

#[cfg(unix)]
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    f.write_all(bytes)
}

#[cfg(not(unix))]
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    std::fs::write(path, bytes)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn config_err(e: impl fmt::Display) -> TlsError {
    TlsError::Config { detail: e.to_string() }
}

fn certs(pem: &[u8], path: &str, what: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Pem { what, path: path.to_owned(), detail: e.to_string() })?;
    if certs.is_empty() {
        return Err(TlsError::Pem { what, path: path.to_owned(), detail: "no CERTIFICATE block".into() });
    }
    Ok(certs)
}

fn read(path: &Path, what: &'static str) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError::Read { what, path: path.display().to_string(), detail: e.to_string() })
}

impl Tls {
    /// From PEM bytes: this end's certificate chain and key, and the CA certificate(s) peers must
    /// chain to. `server_name`: what peers' server certificates must be valid for (default
    /// [`DEFAULT_SERVER_NAME`]).
    pub fn from_pem(cert: &[u8], key: &[u8], ca: &[u8], server_name: Option<&str>) -> Result<Self, TlsError> {
        Self::build(cert, key, ca, server_name, ["memory"; 3])
    }

    fn build(
        cert: &[u8],
        key: &[u8],
        ca: &[u8],
        server_name: Option<&str>,
        names: [&str; 3],
    ) -> Result<Self, TlsError> {
        let chain = certs(cert, names[0], "certificate")?;
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| TlsError::Pem {
            what: "private key",
            path: names[1].to_owned(),
            detail: e.to_string(),
        })?;
        let mut roots = rustls::RootCertStore::empty();
        for c in certs(ca, names[2], "CA certificate")? {
            roots.add(c).map_err(|e| TlsError::Pem {
                what: "CA certificate",
                path: names[2].to_owned(),
                detail: e.to_string(),
            })?;
        }
        let roots = Arc::new(roots);
        let name = server_name.unwrap_or(DEFAULT_SERVER_NAME);
        let server_name = ServerName::try_from(name.to_owned())
            .map_err(|e| TlsError::Config { detail: format!("server name {name:?}: {e}") })?;
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), provider())
            .build()
            .map_err(config_err)?;
        let server = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(config_err)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(config_err)?;
        let client = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(config_err)?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(config_err)?;
        Ok(Self { server: Arc::new(server), client: Arc::new(client), server_name, name: name.to_owned() })
    }

    /// From PEM files.
    pub fn from_files(files: &TlsFiles, server_name: Option<&str>) -> Result<Self, TlsError> {
        let (c, k, a) = (read(&files.cert, "certificate")?, read(&files.key, "private key")?, read(&files.ca, "CA")?);
        let names = [files.cert.display().to_string(), files.key.display().to_string(), files.ca.display().to_string()];
        Self::build(&c, &k, &a, server_name, [&names[0], &names[1], &names[2]])
    }

    /// From the files named by `KVXFER_TLS_CERT`, `KVXFER_TLS_KEY` and `KVXFER_TLS_CA`: `None` when
    /// none is set, an error when only some are or the files are unusable.
    pub fn from_env() -> Result<Option<Self>, TlsError> {
        let vars = [CERT_ENV, KEY_ENV, CA_ENV].map(|v| (v, std::env::var_os(v)));
        let set: Vec<&str> = vars.iter().filter(|(_, x)| x.is_some()).map(|(v, _)| *v).collect();
        if set.is_empty() {
            return Ok(None);
        }
        if set.len() < 3 {
            let missing: Vec<&str> = vars.iter().filter(|(_, x)| x.is_none()).map(|(v, _)| *v).collect();
            return Err(TlsError::Incomplete { set: set.join(", "), missing: missing.join(", ") });
        }
        let [c, k, a] = vars.map(|(_, x)| PathBuf::from(x.unwrap_or_default()));
        Self::from_files(&TlsFiles { cert: c, key: k, ca: a }, None).map(Some)
    }

    /// A fresh cluster CA and a certificate it signed for `kvxfer`, `localhost` and `127.0.0.1`
    /// (ECDSA P-256), and the setup using them: for demos and tests. Other processes of the same
    /// cluster need the same files ([`Generated::write_to`]).
    pub fn generate() -> Result<(Self, Generated), TlsError> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
        };
        let gen = |e: rcgen::Error| TlsError::Generate { detail: e.to_string() };
        let ca_key = KeyPair::generate().map_err(gen)?;
        let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(gen)?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name.push(DnType::CommonName, "kvxfer cluster CA (generated)");
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca.self_signed(&ca_key).map_err(gen)?;
        let key = KeyPair::generate().map_err(gen)?;
        let names = vec![DEFAULT_SERVER_NAME.to_owned(), "localhost".to_owned(), "127.0.0.1".to_owned()];
        let mut leaf = CertificateParams::new(names).map_err(gen)?;
        leaf.distinguished_name.push(DnType::CommonName, "kvxfer rank (generated)");
        leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let cert = leaf.signed_by(&key, &ca_cert, &ca_key).map_err(gen)?;
        let g = Generated { cert_pem: cert.pem(), key_pem: key.serialize_pem(), ca_pem: ca_cert.pem() };
        let tls = Self::from_pem(g.cert_pem.as_bytes(), g.key_pem.as_bytes(), g.ca_pem.as_bytes(), None)?;
        Ok((tls, g))
    }

    /// The name peers' server certificates are checked against.
    pub fn server_name(&self) -> &str {
        &self.name
    }

    /// The rustls server configuration (for code that drives its own streams).
    pub fn server_config(&self) -> Arc<rustls::ServerConfig> {
        Arc::clone(&self.server)
    }

    /// The rustls client configuration.
    pub fn client_config(&self) -> Arc<rustls::ClientConfig> {
        Arc::clone(&self.client)
    }

    /// TLS over a connected stream, as the client, within `timeout`.
    pub async fn connect(&self, tcp: TcpStream, timeout: Duration) -> Result<ClientStream<TcpStream>, TlsError> {
        let peer = peer_of(&tcp);
        self.connect_over(tcp, &peer, timeout).await
    }

    /// TLS over an accepted stream, as the server, within `timeout`.
    pub async fn accept(&self, tcp: TcpStream, timeout: Duration) -> Result<ServerStream<TcpStream>, TlsError> {
        let peer = peer_of(&tcp);
        self.accept_over(tcp, &peer, timeout).await
    }

    /// TLS over any connected transport (for example a wrapper of a TCP stream that can move between
    /// runtimes), as the client, within `timeout`; `peer` names it in errors.
    pub async fn connect_over<IO>(&self, io: IO, peer: &str, timeout: Duration) -> Result<ClientStream<IO>, TlsError>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let c = tokio_rustls::TlsConnector::from(Arc::clone(&self.client));
        finished(peer, timeout, tokio::time::timeout(timeout, c.connect(self.server_name.clone(), io)).await)
    }

    /// TLS over any accepted transport, as the server, within `timeout`; `peer` names it in errors.
    pub async fn accept_over<IO>(&self, io: IO, peer: &str, timeout: Duration) -> Result<ServerStream<IO>, TlsError>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let a = tokio_rustls::TlsAcceptor::from(Arc::clone(&self.server));
        finished(peer, timeout, tokio::time::timeout(timeout, a.accept(io)).await)
    }
}

fn finished<S>(
    peer: &str,
    timeout: Duration,
    r: Result<std::io::Result<S>, tokio::time::error::Elapsed>,
) -> Result<S, TlsError> {
    match r {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(TlsError::Handshake { peer: peer.to_owned(), detail: e.to_string() }),
        Err(_) => {
            Err(TlsError::Handshake { peer: peer.to_owned(), detail: format!("not finished within {timeout:?}") })
        }
    }
}

fn peer_of(tcp: &TcpStream) -> String {
    tcp.peer_addr().map_or_else(|_| "an unknown peer".into(), |a| a.to_string())
}
