//! Where a request stands, as the engine API reports it on either side ([`Phase`]).

use std::fmt;

use serde::{Deserialize, Serialize};

/// Where a request stands (SGLang's `KVPoll`, plus `Aborting`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The peers this request needs are not connected yet (prefill: or not every decode rank's page
    /// list arrived yet).
    Bootstrapping,
    /// Ready for the engine's input: decode: hand off the page list (`Receiver::send_metadata`);
    /// prefill: send (`Sender::send`).
    WaitingForInput,
    /// Bytes are moving; nothing to do but poll.
    Transferring,
    /// Every byte landed (decode: verified by every sender's notification; prefill: every write
    /// completed and every receiver notified).
    Success,
    /// Failed or aborted, and not every write has been fenced yet: the pages are NOT free.
    Aborting,
    /// Failed or aborted; nothing of it can land any more.
    Failed,
}

impl Phase {
    /// Whether the request has an outcome ([`Phase::Success`] or [`Phase::Failed`]).
    pub fn is_final(self) -> bool {
        matches!(self, Phase::Success | Phase::Failed)
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Phase::Bootstrapping => "bootstrapping",
            Phase::WaitingForInput => "waiting for input",
            Phase::Transferring => "transferring",
            Phase::Success => "succeeded",
            Phase::Aborting => "aborting",
            Phase::Failed => "failed",
        };
        f.write_str(s)
    }
}
