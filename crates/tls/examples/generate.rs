//! Writes a generated cluster pair for a demo: `cert.pem`, `key.pem` (mode 0600) and `ca.pem` in the
//! directory given (default `./kvxfer-tls`), and prints the environment that points kvxfer at them.
//!
//! ```text
//! cargo run -p kvxfer-tls --example generate -- /tmp/kvxfer-tls
//! ```
//!
//! Every process of the cluster needs the same files (one CA, one certificate valid for `kvxfer`,
//! `localhost` and `127.0.0.1`). For production, issue one certificate per host from your own CA.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "kvxfer-tls".into()));
    let (_, generated) = kvxfer_tls::Tls::generate()?;
    let files = generated.write_to(&dir)?;
    println!("export {}={}", kvxfer_tls::CERT_ENV, files.cert.display());
    println!("export {}={}", kvxfer_tls::KEY_ENV, files.key.display());
    println!("export {}={}", kvxfer_tls::CA_ENV, files.ca.display());
    Ok(())
}
