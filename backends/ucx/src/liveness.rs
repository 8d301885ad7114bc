//! Same-host process liveness, for endpoints UCX cannot watch.
//!
//! UCX 1.13's shared-memory transports (posix, sysv, self) support no peer error handling, so an
//! endpoint that runs over them uses `UCP_ERR_HANDLING_MODE_NONE` and UCX never reports the peer's
//! death. Peers on shared memory are by definition on this host, so the backend watches the peer
//! process itself: its boot id, pid and start time (from `/proc`) are in the metadata and the
//! hello; a peer whose `/proc/<pid>/stat` is gone or shows another start time has died.

use serde::{Deserialize, Serialize};

/// Which process on which host (boot) an endpoint lives in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ProcId {
    /// `/proc/sys/kernel/random/boot_id` (empty where unavailable).
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// Start time in clock ticks since boot (`/proc/<pid>/stat` field 22); 0 where unavailable.
    pub start: u64,
}

/// The start time of a running process (`None` when gone, a zombie, or unreadable).
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 2 (comm) is in parentheses and may contain spaces: count fields after the last ')'.
    let mut rest = stat[stat.rfind(')')? + 1..].split_whitespace();
    // rest starts with field 3 (state); a killed process not yet reaped is a zombie (Z) or dead (X).
    if matches!(rest.next()?, "Z" | "X" | "x") {
        return None;
    }
    // starttime is field 22.
    rest.nth(18)?.parse().ok()
}

impl ProcId {
    /// This process.
    pub fn current() -> Self {
        let host =
            std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_owned()).unwrap_or_default();
        let pid = std::process::id();
        Self { host, pid, start: start_time(pid).unwrap_or(0) }
    }

    /// Whether the process is known dead: `Some(false)` when it is on this host and gone (or its
    /// pid now names another process), `Some(true)` when alive, `None` when it cannot be known
    /// (another host, or no `/proc`).
    pub fn alive(&self, me: &ProcId) -> Option<bool> {
        if self.host.is_empty() || self.host != me.host || self.start == 0 {
            return None;
        }
        if self.pid == me.pid {
            return Some(true);
        }
        match start_time(self.pid) {
            None => Some(false),
            Some(t) => Some(t == self.start),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_a_finished_child_is_not() {
        let me = ProcId::current();
        assert!(me.start > 0 && !me.host.is_empty(), "{me:?}");
        assert_eq!(me.alive(&me), Some(true));
        let mut child = std::process::Command::new("sleep").arg("0.2").spawn().unwrap();
        let them = ProcId { host: me.host.clone(), pid: child.id(), start: start_time(child.id()).unwrap() };
        assert_eq!(them.alive(&me), Some(true));
        // Killed but not reaped (a zombie) already counts as dead.
        child.kill().unwrap();
        let t0 = std::time::Instant::now();
        while them.alive(&me) != Some(false) && t0.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(them.alive(&me), Some(false));
        child.wait().unwrap();
        assert_eq!(them.alive(&me), Some(false));
        let elsewhere = ProcId { host: "another-boot".into(), ..them };
        assert_eq!(elsewhere.alive(&me), None);
    }
}
