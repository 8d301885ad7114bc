//! `--metrics-listen ADDR`: the OpenMetrics text of a worker, the bootstrap service or a whole demo
//! over HTTP (`GET /metrics`), for Prometheus to scrape; and the demo's side of it: a scrape of
//! one worker, and the merge of several workers' texts into one exposition.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use axum::http::header::CONTENT_TYPE;

/// The content type of the OpenMetrics text format.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What a scrape returns (called on each scrape, on the runtime's threads; must not block long).
pub type Source = Arc<dyn Fn() -> String + Send + Sync>;

/// Serves `source()` at `GET /metrics` on `addr` (`127.0.0.1:0` picks a free port) until the
/// runtime stops. Returns the address bound. Errors name the flag and the address.
pub async fn serve(addr: &str, source: Source) -> Result<SocketAddr, String> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("--metrics-listen {addr}: cannot listen: {e}"))?;
    let local = listener.local_addr().map_err(|e| format!("--metrics-listen {addr}: {e}"))?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let source = Arc::clone(&source);
            async move {
                // The source may block briefly (locks; the demo scrapes its workers): off the runtime.
                let body = tokio::task::spawn_blocking(move || source())
                    .await
                    .unwrap_or_else(|e| format!("# kvxfer: encoding the metrics failed: {e}\n# EOF\n"));
                ([(CONTENT_TYPE, OPENMETRICS)], body)
            }
        }),
    );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("kvxfer: the metrics listener on {local} stopped: {e}");
        }
    });
    Ok(local)
}

/// `GET http://addr/metrics`, bounded by `timeout` for the connect and for each read and write.
/// Returns the body of a `200` answer.
pub fn scrape(addr: SocketAddr, timeout: Duration) -> Result<String, String> {
    let fail = |e: std::io::Error| format!("scraping http://{addr}/metrics: {e}");
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(fail)?;
    s.set_read_timeout(Some(timeout)).map_err(fail)?;
    s.set_write_timeout(Some(timeout)).map_err(fail)?;
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nAccept: {OPENMETRICS}\r\nConnection: close\r\n\r\n")
        .map_err(fail)?;
    let mut raw = Vec::new();
    // At most 64 MiB: an exposition of one rank is a few KiB.
    s.take(64 << 20).read_to_end(&mut raw).map_err(fail)?;
    let text =
        String::from_utf8(raw).map_err(|_| format!("scraping http://{addr}/metrics: the answer is not UTF-8"))?;
    let (head, body) =
        text.split_once("\r\n\r\n").ok_or_else(|| format!("scraping http://{addr}/metrics: no HTTP header"))?;
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(format!("scraping http://{addr}/metrics: answered `{status}`"));
    }
    if head.lines().any(|l| l.to_ascii_lowercase().starts_with("transfer-encoding: chunked")) {
        return Err(format!("scraping http://{addr}/metrics: a chunked answer (not expected from kvxfer)"));
    }
    Ok(body.to_owned())
}

/// Merges OpenMetrics texts of several processes into one exposition: each metric family once (its
/// `# HELP`/`# TYPE`/`# UNIT` from the first text that has it), its samples from every text in
/// order, one `# EOF`. The texts' samples must differ in their labels (each kvxfer agent labels
/// its samples with its role and rank).
pub fn merge(texts: &[String]) -> String {
    let mut order: Vec<String> = Vec::new();
    let mut families: HashMap<String, (Vec<String>, Vec<String>)> = HashMap::new();
    for text in texts {
        let mut current: Option<String> = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# ") {
                let mut words = rest.splitn(3, ' ');
                let (kind, name) = (words.next().unwrap_or_default(), words.next().unwrap_or_default());
                if !matches!(kind, "HELP" | "TYPE" | "UNIT") || name.is_empty() {
                    continue; // `# EOF` and comments
                }
                let fam = families.entry(name.to_owned()).or_insert_with(|| {
                    order.push(name.to_owned());
                    (Vec::new(), Vec::new())
                });
                let tag = format!("# {kind} ");
                if !fam.0.iter().any(|m| m.starts_with(&tag)) {
                    fam.0.push(line.to_owned());
                }
                current = Some(name.to_owned());
            } else if !line.is_empty() {
                let name = current.clone().unwrap_or_default();
                families
                    .entry(name.clone())
                    .or_insert_with(|| {
                        order.push(name.clone());
                        (Vec::new(), Vec::new())
                    })
                    .1
                    .push(line.to_owned());
            }
        }
    }
    let mut out = String::new();
    for name in &order {
        let (meta, samples) = &families[name];
        for l in meta.iter().chain(samples) {
            out.push_str(l);
            out.push('\n');
        }
    }
    out.push_str("# EOF\n");
    out
}

#[cfg(test)]
/// The value of the sample whose name and labels are exactly `series` (for example
/// `kvxfer_requests_total{outcome="success",role="decode",tp="0",pp="0"}`), if present.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.split(' ').next()?.parse().ok())
}

#[cfg(test)]
/// The sum over every sample of metric `name` whose labels include all of `labels` (`k="v"` each).
pub fn sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
            (n == name && labels.iter().all(|want| rest.contains(want))).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

/// Blocks until standard input is closed (or reaches its end), at most `limit`: how a finished
/// process keeps serving its final metrics until whoever started it has scraped them.
pub fn hold(limit: Duration) {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    // The reading thread is left behind if the limit passes first; the process exits right after.
    let spawned = std::thread::Builder::new().name("kvxfer-hold".into()).spawn(move || {
        let mut sink = [0u8; 4096];
        let mut stdin = std::io::stdin().lock();
        while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
        let _ = tx.send(());
    });
    if spawned.is_ok() {
        let _ = rx.recv_timeout(limit);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "# HELP kvxfer_x help x.\n# TYPE kvxfer_x counter\nkvxfer_x_total{role=\"prefill\"} 2\n\
                     # HELP kvxfer_y help y.\n# TYPE kvxfer_y gauge\nkvxfer_y{role=\"prefill\"} 1\n# EOF\n";
    const B: &str = "# HELP kvxfer_x help x.\n# TYPE kvxfer_x counter\nkvxfer_x_total{role=\"decode\"} 5\n# EOF\n";

    #[test]
    fn merge_keeps_one_header_per_family_and_every_sample() {
        let m = merge(&[A.to_owned(), B.to_owned()]);
        assert_eq!(
            m,
            "# HELP kvxfer_x help x.\n# TYPE kvxfer_x counter\nkvxfer_x_total{role=\"prefill\"} 2\n\
             kvxfer_x_total{role=\"decode\"} 5\n# HELP kvxfer_y help y.\n# TYPE kvxfer_y gauge\n\
             kvxfer_y{role=\"prefill\"} 1\n# EOF\n"
        );
        assert_eq!(sum(&m, "kvxfer_x_total", &[]), 7.0);
        assert_eq!(sum(&m, "kvxfer_x_total", &["role=\"decode\""]), 5.0);
        assert_eq!(sample(&m, "kvxfer_y{role=\"prefill\"}"), Some(1.0));
        assert_eq!(sample(&m, "kvxfer_y{role=\"decode\"}"), None);
        assert_eq!(merge(&[]), "# EOF\n");
    }

    #[test]
    fn serve_and_scrape() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let addr = rt.block_on(serve("127.0.0.1:0", Arc::new(|| A.to_owned()))).unwrap();
        let got = scrape(addr, Duration::from_secs(5)).unwrap();
        assert_eq!(got, A);
        // Nothing listens there any more once the runtime is gone: a clear error, no hang.
        drop(rt);
        let e = scrape(addr, Duration::from_secs(2)).unwrap_err();
        assert!(e.contains("scraping http://"), "{e}");
        let e = rt_free_bind_error();
        assert!(e.contains("--metrics-listen"), "{e}");
    }

    fn rt_free_bind_error() -> String {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(serve("256.0.0.1:1", Arc::new(String::new))).unwrap_err()
    }
}
