//! Test support shared by the CLI's integration tests: a pair of network namespaces joined by a veth
//! pair, made by the test itself and deleted when dropped.

use std::process::Command;

/// Runs `ip` with arguments; Ok if it exits 0.
fn ip(args: &[&str]) -> Result<(), String> {
    let o = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&o.stderr).trim()))
    }
}

/// Two namespaces `a` and `b`, addresses `10.231.<subnet>.1` in `a` and `.2` in `b`, loopback up in
/// both. Both namespaces are deleted on drop (also when creating them failed half-way).
pub struct NetnsPair {
    /// The first namespace.
    pub a: String,
    /// The second namespace.
    pub b: String,
    /// The address in `a`.
    pub addr_a: String,
    /// The address in `b`.
    pub addr_b: String,
    /// The veth end in `a` (for backends that pick a device by name, like UCX's `net_devices`).
    pub veth_a: String,
    /// The veth end in `b`.
    pub veth_b: String,
}

impl NetnsPair {
    /// Creates the pair; names end in the process id so parallel runs do not collide. An error says
    /// why namespaces cannot be made here (not root, no `ip`).
    pub fn create(prefix: &str, subnet: u8) -> Result<Self, String> {
        let tag = std::process::id() % 100_000;
        let pair = NetnsPair {
            a: format!("{prefix}a{tag}"),
            b: format!("{prefix}b{tag}"),
            addr_a: format!("10.231.{subnet}.1"),
            addr_b: format!("10.231.{subnet}.2"),
            veth_a: format!("{prefix}va{tag}"),
            veth_b: format!("{prefix}vb{tag}"),
        };
        let (a, b) = (&pair.a, &pair.b);
        ip(&["netns", "add", a])?;
        ip(&["netns", "add", b])?;
        let (va, vb) = (&pair.veth_a, &pair.veth_b);
        ip(&["link", "add", va, "type", "veth", "peer", "name", vb])?;
        ip(&["link", "set", va, "netns", a])?;
        ip(&["link", "set", vb, "netns", b])?;
        ip(&["-n", a, "addr", "add", &format!("{}/24", pair.addr_a), "dev", va])?;
        ip(&["-n", b, "addr", "add", &format!("{}/24", pair.addr_b), "dev", vb])?;
        for (ns, v) in [(a, va), (b, vb)] {
            ip(&["-n", ns, "link", "set", v, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(pair)
    }
}

impl Drop for NetnsPair {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}
