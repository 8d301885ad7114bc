//! `kvxfer bootstrap`: the bootstrap service alone (for workers started by hand on several hosts),
//! with its limits and optional shared secret.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::builder::TypedValueParser as _;

use kvxfer::bootstrap::{
    raise_open_file_limit, BootstrapServer, Limits, Secret, ServerConfig, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_SOURCE, DEFAULT_MAX_VALUE_BYTES, DEFAULT_MAX_WAITS, MAX_REQUEST_LINE, SECRET_ENV,
};

/// Descriptors the service needs besides its connections (listener, runtime, refusals lingering).
const SPARE_FILES: u64 = 128;

/// Arguments of `kvxfer bootstrap`.
#[derive(Debug, Clone, clap::Args)]
pub struct BootstrapArgs {
    /// Address to listen on (`0.0.0.0:7878` to accept workers of other hosts).
    #[arg(long, default_value = "127.0.0.1:7878")]
    pub listen: String,
    /// Stop after this many seconds (default: run until killed).
    #[arg(long, value_parser = crate::model::parse_seconds)]
    pub for_s: Option<f64>,
    /// Connections open at once; one beyond gets an error line and is closed. The service raises its
    /// open-file soft limit to fit (up to the hard limit).
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS, value_parser = clap::value_parser!(u64).range(1..=1_000_000).map(|v| v as usize))]
    pub max_connections: usize,
    /// Connections open at once from one source address; one beyond gets an error line and is closed
    /// while other sources are still served.
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS_PER_SOURCE, value_parser = clap::value_parser!(u64).range(1..=1_000_000).map(|v| v as usize))]
    pub max_connections_per_source: usize,
    /// Waits held at once (get, peers, store watches); one beyond is answered with an error.
    #[arg(long, default_value_t = DEFAULT_MAX_WAITS)]
    pub max_waits: usize,
    /// Largest stored value (put, store put/create), in bytes of JSON.
    #[arg(long, default_value_t = DEFAULT_MAX_VALUE_BYTES, value_parser = clap::value_parser!(u64).range(1..=1 << 30).map(|v| v as usize))]
    pub max_value_bytes: usize,
    /// Longest request line, in bytes (applied while reading).
    #[arg(long, default_value_t = MAX_REQUEST_LINE, value_parser = clap::value_parser!(u64).range(1024..=1 << 30).map(|v| v as usize))]
    pub max_line_bytes: usize,
    /// Seconds a connection may take to send its whole request line (however slowly), then it is
    /// answered an error and closed; and to read its whole answer, then it is closed.
    #[arg(long, default_value_t = 30.0, value_parser = crate::model::parse_seconds)]
    pub idle_timeout_s: f64,
    /// Require the shared secret in this file (its bytes, trailing line breaks dropped): every request
    /// must prove it (HMAC challenge-response; the secret never crosses the wire). Without it, the
    /// environment variable KVXFER_SECRET is used if set; without either, anyone who can reach the
    /// port can read and write every key.
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// Speak TLS (mutual, cluster CA) with this certificate (PEM); needs --tls-key and --tls-ca.
    /// Without the three flags, KVXFER_TLS_CERT / KVXFER_TLS_KEY / KVXFER_TLS_CA are used if set.
    #[arg(long, requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, requires_all = ["tls_cert", "tls_ca"])]
    pub tls_key: Option<PathBuf>,
    /// The cluster CA certificate (PEM): the only root trusted for clients' certificates.
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    /// Serve the service's counters (connections, ranks, waits, refusals; OpenMetrics text) at
    /// `http://ADDR/metrics`. Plain HTTP without the secret: listen on an address only your
    /// monitoring reaches.
    #[arg(long)]
    pub metrics_listen: Option<String>,
}

/// The TLS setup of the flags, else of the environment, else none.
fn load_tls(args: &BootstrapArgs) -> Result<Option<kvxfer_tls::Tls>, String> {
    match (&args.tls_cert, &args.tls_key, &args.tls_ca) {
        (Some(cert), Some(key), Some(ca)) => {
            let files = kvxfer_tls::TlsFiles { cert: cert.clone(), key: key.clone(), ca: ca.clone() };
            warn_if_readable_by_others(key);
            kvxfer_tls::Tls::from_files(&files, None).map(Some).map_err(|e| e.to_string())
        }
        _ => kvxfer_tls::Tls::from_env().map_err(|e| e.to_string()),
    }
}

/// Where the secret came from, for the start-up note (never the secret itself).
fn load_secret(args: &BootstrapArgs) -> Result<Option<(Secret, String)>, String> {
    if let Some(path) = &args.secret_file {
        let s = Secret::from_file(path).map_err(|e| e.to_string())?;
        warn_if_readable_by_others(path);
        if std::env::var_os(SECRET_ENV).is_some() {
            eprintln!("kvxfer bootstrap: {SECRET_ENV} is set too; using --secret-file");
        }
        return Ok(Some((s, format!("--secret-file {}", path.display()))));
    }
    Ok(Secret::from_env().map_err(|e| e.to_string())?.map(|s| (s, SECRET_ENV.to_owned())))
}

#[cfg(unix)]
fn warn_if_readable_by_others(path: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(m) = std::fs::metadata(path) {
        if m.permissions().mode() & 0o077 != 0 {
            eprintln!(
                "kvxfer bootstrap: warning: {} is readable by other users (mode {:o}); `chmod 600` it",
                path.display(),
                m.permissions().mode() & 0o777
            );
        }
    }
}

#[cfg(not(unix))]
fn warn_if_readable_by_others(_: &std::path::Path) {}

/// Runs the bootstrap service alone.
pub fn run(args: &BootstrapArgs) -> ExitCode {
    let secret = match load_secret(args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvxfer bootstrap: {e}");
            return ExitCode::FAILURE;
        }
    };
    let tls = match load_tls(args) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("kvxfer bootstrap: {e}");
            return ExitCode::FAILURE;
        }
    };
    let limits = Limits {
        max_connections: args.max_connections,
        max_connections_per_source: args.max_connections_per_source,
        max_waits: args.max_waits,
        max_value_bytes: args.max_value_bytes,
        max_request_line: args.max_line_bytes,
        idle_timeout: Duration::from_secs_f64(args.idle_timeout_s),
    };
    // Each connection is a descriptor: make room for the limit, within the hard limit.
    let want = args.max_connections as u64 + SPARE_FILES;
    match raise_open_file_limit(want) {
        Ok(have) if have < want => eprintln!(
            "kvxfer bootstrap: warning: the open-file limit is {have} (hard limit reached), below the {want} that \
             --max-connections {} needs; beyond about {} connections accepting fails and the service pauses \
             briefly between tries; raise `ulimit -Hn` or lower --max-connections",
            args.max_connections,
            have.saturating_sub(SPARE_FILES)
        ),
        Ok(_) => {}
        Err(e) => eprintln!("kvxfer bootstrap: warning: cannot raise the open-file limit: {e}"),
    }
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvxfer bootstrap: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async {
        let from = secret.as_ref().map(|(_, from)| from.clone());
        let with_tls = tls.is_some();
        let config = ServerConfig { secret: secret.map(|(s, _)| s), limits, tls };
        let server = match BootstrapServer::start_with(&args.listen, config).await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("kvxfer bootstrap: {e}");
                return ExitCode::FAILURE;
            }
        };
        println!("bootstrap listening on {}", server.addr());
        let server = std::sync::Arc::new(server);
        if let Some(listen) = &args.metrics_listen {
            let s = std::sync::Arc::clone(&server);
            match crate::metrics_http::serve(listen, std::sync::Arc::new(move || kvxfer::metrics::encode_bootstrap(&s.stats())))
                .await
            {
                Ok(a) => eprintln!("kvxfer bootstrap: metrics at http://{a}/metrics"),
                Err(e) => {
                    eprintln!("kvxfer bootstrap: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        if with_tls {
            eprintln!("kvxfer bootstrap: TLS on every connection (clients need a certificate of the same cluster CA)");
        }
        match from {
            Some(from) => eprintln!("kvxfer bootstrap: every request must prove the shared secret from {from}"),
            None => eprintln!(
                "kvxfer bootstrap: no shared secret: anyone who can reach {} can read and write every key and \
                 registration (give --secret-file or {SECRET_ENV} to require one)",
                server.addr()
            ),
        }
        let l = server.limits();
        eprintln!(
            "kvxfer bootstrap: limits: {} connections ({} per source), {} waits, values up to {} bytes, lines up to {} bytes, \
             request line within {:?}",
            l.max_connections, l.max_connections_per_source, l.max_waits, l.max_value_bytes, l.max_request_line, l.idle_timeout
        );
        match args.for_s {
            Some(s) => tokio::time::sleep(Duration::from_secs_f64(s.max(0.0))).await,
            None => std::future::pending::<()>().await,
        }
        ExitCode::SUCCESS
    })
}
