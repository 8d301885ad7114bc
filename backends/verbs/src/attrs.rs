//! Queue-pair attributes for the RESET → INIT → RTR → RTS transitions, built from exchanged metadata.
//!
//! Pure functions (no device needed), so every field is unit-tested.

use ibverbs_sys as sys;
use sys::ibv_qp_attr_mask as M;

/// Link layer value of InfiniBand ports.
pub const LINK_IB: u8 = 1;
/// Link layer value of Ethernet (RoCE) ports.
pub const LINK_ETHERNET: u8 = 2;

/// Retry and timing parameters of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout (14 ≈ 67 ms).
    pub timeout: u8,
    /// Transport retries before a work request fails with RETRY_EXC_ERR (at most 7).
    pub retry_cnt: u8,
    /// RNR retries (7 = retry forever while the peer has no receive posted).
    pub rnr_retry: u8,
    /// Minimal RNR NAK timer code advertised to the peer (12 ≈ 0.64 ms).
    pub min_rnr_timer: u8,
}

impl Default for Timing {
    fn default() -> Self {
        Self { timeout: 14, retry_cnt: 7, rnr_retry: 7, min_rnr_timer: 12 }
    }
}

/// This side's port, as the QP is built on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalPort {
    /// Port number (from 1).
    pub port_num: u8,
    /// Source GID index (used with a global route).
    pub gid_index: u8,
    /// Link layer ([`LINK_IB`] or [`LINK_ETHERNET`]).
    pub link_layer: u8,
    /// Active MTU (`ibv_mtu`, 1..=5).
    pub active_mtu: u32,
}

/// What the peer told us about its queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteQp {
    /// Its QP number.
    pub qp_num: u32,
    /// Its initial send PSN (our receive PSN).
    pub psn: u32,
    /// Its LID (0 on RoCE).
    pub lid: u16,
    /// Its GID.
    pub gid: [u8; 16],
    /// Its active MTU (`ibv_mtu`).
    pub mtu: u32,
}

/// Bytes of an `ibv_mtu` value, or None if it is not one.
pub fn mtu_bytes(mtu: u32) -> Option<u32> {
    (1..=5).contains(&mtu).then(|| 128u32 << mtu)
}

/// Whether the address vector needs a global route header: always on Ethernet (RoCE), and on
/// InfiniBand when the peer has no LID (a routed fabric).
pub fn needs_grh(local: &LocalPort, remote: &RemoteQp) -> bool {
    local.link_layer == LINK_ETHERNET || remote.lid == 0
}

/// RESET → INIT: port, pkey 0, remote write allowed (peers RDMA WRITE into our regions and rings).
pub fn init(local: &LocalPort) -> (sys::ibv_qp_attr, M) {
    let attr = sys::ibv_qp_attr {
        qp_state: sys::ibv_qp_state::IBV_QPS_INIT,
        pkey_index: 0,
        port_num: local.port_num,
        qp_access_flags: (sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0,
        ..Default::default()
    };
    (attr, M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS)
}

/// INIT → RTR: the address vector to the peer, the path MTU both support, the peer's QP number and
/// PSN.
pub fn rtr(local: &LocalPort, remote: &RemoteQp, timing: &Timing) -> (sys::ibv_qp_attr, M) {
    let mut attr = sys::ibv_qp_attr {
        qp_state: sys::ibv_qp_state::IBV_QPS_RTR,
        path_mtu: local.active_mtu.min(remote.mtu),
        dest_qp_num: remote.qp_num,
        rq_psn: remote.psn & 0x00ff_ffff,
        max_dest_rd_atomic: 1,
        min_rnr_timer: timing.min_rnr_timer,
        ..Default::default()
    };
    attr.ah_attr.port_num = local.port_num;
    attr.ah_attr.sl = 0;
    attr.ah_attr.src_path_bits = 0;
    attr.ah_attr.dlid = remote.lid;
    if needs_grh(local, remote) {
        attr.ah_attr.is_global = 1;
        attr.ah_attr.grh.dgid = sys::ibv_gid { raw: remote.gid };
        attr.ah_attr.grh.sgid_index = local.gid_index;
        attr.ah_attr.grh.hop_limit = 64;
        attr.ah_attr.grh.traffic_class = 0;
        attr.ah_attr.grh.flow_label = 0;
    }
    (
        attr,
        M::IBV_QP_STATE
            | M::IBV_QP_AV
            | M::IBV_QP_PATH_MTU
            | M::IBV_QP_DEST_QPN
            | M::IBV_QP_RQ_PSN
            | M::IBV_QP_MAX_DEST_RD_ATOMIC
            | M::IBV_QP_MIN_RNR_TIMER,
    )
}

/// RTR → RTS: our send PSN and the retry policy.
pub fn rts(local_psn: u32, timing: &Timing) -> (sys::ibv_qp_attr, M) {
    let attr = sys::ibv_qp_attr {
        qp_state: sys::ibv_qp_state::IBV_QPS_RTS,
        sq_psn: local_psn & 0x00ff_ffff,
        timeout: timing.timeout,
        retry_cnt: timing.retry_cnt.min(7),
        rnr_retry: timing.rnr_retry.min(7),
        max_rd_atomic: 1,
        ..Default::default()
    };
    (
        attr,
        M::IBV_QP_STATE
            | M::IBV_QP_SQ_PSN
            | M::IBV_QP_TIMEOUT
            | M::IBV_QP_RETRY_CNT
            | M::IBV_QP_RNR_RETRY
            | M::IBV_QP_MAX_QP_RD_ATOMIC,
    )
}

/// Any state → ERR: flushes outstanding work requests (used on disconnect).
pub fn error() -> (sys::ibv_qp_attr, M) {
    (sys::ibv_qp_attr { qp_state: sys::ibv_qp_state::IBV_QPS_ERR, ..Default::default() }, M::IBV_QP_STATE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(link: u8) -> LocalPort {
        LocalPort { port_num: 1, gid_index: 3, link_layer: link, active_mtu: 5 }
    }

    fn remote(lid: u16) -> RemoteQp {
        RemoteQp { qp_num: 0x1234, psn: 0xabcdef, lid, gid: [7; 16], mtu: 3 }
    }

    #[test]
    fn init_sets_port_and_remote_write() {
        let (a, m) = init(&port(LINK_IB));
        assert_eq!(a.qp_state, sys::ibv_qp_state::IBV_QPS_INIT);
        assert_eq!(a.port_num, 1);
        assert_eq!(a.pkey_index, 0);
        assert_eq!(a.qp_access_flags, 3, "LOCAL_WRITE | REMOTE_WRITE");
        assert_eq!(m, M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS);
    }

    #[test]
    fn rtr_on_infiniband_uses_the_lid() {
        let t = Timing::default();
        let (a, m) = rtr(&port(LINK_IB), &remote(17), &t);
        assert_eq!(a.qp_state, sys::ibv_qp_state::IBV_QPS_RTR);
        assert_eq!(a.dest_qp_num, 0x1234);
        assert_eq!(a.rq_psn, 0xabcdef);
        assert_eq!(a.path_mtu, 3, "min of local 4096 and remote 1024");
        assert_eq!(a.ah_attr.dlid, 17);
        assert_eq!(a.ah_attr.is_global, 0);
        assert_eq!(a.ah_attr.port_num, 1);
        assert_eq!(a.min_rnr_timer, 12);
        assert_eq!(a.max_dest_rd_atomic, 1);
        for bit in [M::IBV_QP_AV, M::IBV_QP_PATH_MTU, M::IBV_QP_DEST_QPN, M::IBV_QP_RQ_PSN, M::IBV_QP_MIN_RNR_TIMER] {
            assert_eq!(m.0 & bit.0, bit.0);
        }
        assert_eq!(m.0 & M::IBV_QP_SQ_PSN.0, 0, "RTR must not set the send PSN");
    }

    #[test]
    fn rtr_on_roce_uses_the_gid() {
        let (a, _) = rtr(&port(LINK_ETHERNET), &remote(17), &Timing::default());
        assert_eq!(a.ah_attr.is_global, 1);
        assert_eq!(crate::ffi::gid_bytes(a.ah_attr.grh.dgid), [7; 16]);
        assert_eq!(a.ah_attr.grh.sgid_index, 3);
        assert_eq!(a.ah_attr.grh.hop_limit, 64);
        // An InfiniBand peer without a LID is routed by GID too.
        let (b, _) = rtr(&port(LINK_IB), &remote(0), &Timing::default());
        assert_eq!(b.ah_attr.is_global, 1);
    }

    #[test]
    fn psn_is_truncated_to_24_bits_and_rts_sets_retries() {
        let t = Timing { timeout: 10, retry_cnt: 9, rnr_retry: 7, min_rnr_timer: 1 };
        let (a, m) = rts(0xff12_3456, &t);
        assert_eq!(a.qp_state, sys::ibv_qp_state::IBV_QPS_RTS);
        assert_eq!(a.sq_psn, 0x12_3456);
        assert_eq!(a.timeout, 10);
        assert_eq!(a.retry_cnt, 7, "clamped to the 3-bit field");
        assert_eq!(a.rnr_retry, 7);
        assert_eq!(a.max_rd_atomic, 1);
        assert_eq!(m.0 & M::IBV_QP_AV.0, 0, "RTS must not touch the address vector");
        let mut r = remote(1);
        r.psn = 0xff00_0001;
        assert_eq!(rtr(&port(LINK_IB), &r, &t).0.rq_psn, 1);
    }

    #[test]
    fn error_transition_and_mtu_table() {
        let (a, m) = error();
        assert_eq!(a.qp_state, sys::ibv_qp_state::IBV_QPS_ERR);
        assert_eq!(m, M::IBV_QP_STATE);
        assert_eq!(mtu_bytes(1), Some(256));
        assert_eq!(mtu_bytes(5), Some(4096));
        assert_eq!(mtu_bytes(0), None);
        assert_eq!(mtu_bytes(6), None);
    }
}
